"""The `qmq` command: one sub-command per role or task. Nothing imports this package."""
