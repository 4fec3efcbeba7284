"""The ``qmq`` command (the console script and ``python -m qmq``).

A shim before the command itself: ``pip install qmq`` is the client SDK alone, without
click and rich, and the command then says which extra to install instead of a traceback.
"""

import importlib.util
import sys

# the modules of the cli extra (pyproject.toml) the command imports before any sub-command
_CLI_MODULES = ("click", "rich")


def main() -> None:
    for module in _CLI_MODULES:
        if importlib.util.find_spec(module) is None:
            print(
                f"qmq: error: the qmq command needs the cli extra, which is not installed (no module {module!r}): "
                "pip install 'qmq[cli]' (or 'qmq[server]' to run the servers too)",
                file=sys.stderr,
            )
            sys.exit(1)
    from qmq.cli.main import main as run

    run()


if __name__ == "__main__":
    main()
