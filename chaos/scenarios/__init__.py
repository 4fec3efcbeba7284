"""One module per fault scenario; each has ``run(settings) -> list[Result]``."""
