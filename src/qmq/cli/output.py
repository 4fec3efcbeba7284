"""How the ``qmq`` command prints: rich tables on a terminal, whole values anywhere else, JSON
for scripts.

Piped into a file or another program, a rich table would be squeezed into 80 columns and
cut values (a message id ``26112405574612…`` cannot be pasted into ``qmq resend-dead``), so
off a terminal every table prints as tab-separated lines: a header line, then one line a
row, each value whole (tabs and line breaks inside a value become spaces). ``--json``
prints one JSON document, or JSON lines where the command streams; each command's ``--help``
says which.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from typing import Any, Literal, TypeVar

import click
from rich.console import Console
from rich.errors import MarkupError
from rich.table import Table
from rich.text import Text

F = TypeVar("F", bound=Callable[..., Any])

JsonShape = Literal["document", "lines"]


def json_option(shape: JsonShape, what: str) -> Callable[[F], F]:
    """A ``--json`` flag (parameter ``as_json``) whose help says what is printed and in which shape."""
    how = "one JSON document" if shape == "document" else "JSON lines (one JSON object a line, printed as they come)"
    return click.option("--json", "as_json", is_flag=True, help=f"print {what} as {how}")


def echo_json(doc: object) -> None:
    """``doc`` as one line of JSON (a document, or one line of JSON lines); UTF-8 text as is."""
    click.echo(json.dumps(doc, ensure_ascii=False, sort_keys=True, default=str))


def stdout_console() -> Console:
    """A console on stdout: rich on a terminal; elsewhere plain text whose lines are never
    wrapped or cut."""
    if sys.stdout.isatty():
        return Console()
    return Console(soft_wrap=True, highlight=False, no_color=True)


def print_table(console: Console, table: Table) -> None:
    """``table`` drawn on a terminal, else tab-separated with whole values (module docstring)."""
    if console.is_terminal:
        console.print(table)
        return
    if table.title:
        click.echo(_plain(table.title))
    click.echo("\t".join(_plain(column.header) for column in table.columns))
    cells = [list(column.cells) for column in table.columns]
    for row in zip(*cells, strict=True):
        click.echo("\t".join(_plain(cell) for cell in row))
    if table.caption:
        click.echo(_plain(table.caption))


def _plain(value: object) -> str:
    """A cell's text without rich markup, on one line."""
    if isinstance(value, Text):
        text = value.plain
    elif isinstance(value, str):
        try:
            text = Text.from_markup(value).plain
        except MarkupError:  # a value with brackets of its own, not markup
            text = value
    else:
        text = str(value)
    return " ".join(text.replace("\t", " ").splitlines())
