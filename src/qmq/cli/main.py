"""Entry point of the `qmq` command."""

from __future__ import annotations


def main() -> None:
    raise SystemExit("qmq: the command line is being built")
