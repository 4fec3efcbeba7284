"""Command-line options that mirror configuration fields one for one.

``config_options(Cls, prefix_map)`` turns each field of a config dataclass into a
``--field-name`` option whose help is the field's doc; values stay strings until
``build_config`` checks them, so every bad value gets the same error whatever its source.
"""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any, Literal, TypeVar

import click

from qmq.common.config import build_config, merged

F = TypeVar("F", bound=Callable[..., Any])
T = TypeVar("T")


def config_options(
    cls: type, only: Iterable[str] | None = None, rename: dict[str, str] | None = None
) -> Callable[[F], F]:
    """Decorate a click command with an option per field of ``cls`` (``only`` limits which)."""
    rename = rename or {}
    fields = [f for f in dataclasses.fields(cls) if only is None or f.name in only]
    hints = typing.get_type_hints(cls)

    def decorate(fn: F) -> F:
        for f in reversed(fields):
            flag = "--" + rename.get(f.name, f.name).replace("_", "-")
            default = f.default if f.default is not dataclasses.MISSING else None
            # a bool option given alone (``--accept-progress-loss``) means true; ``--x false`` still works
            flag_value = {"flag_value": "true"} if hints[f.name] is bool else {}
            fn = click.option(
                flag,
                f.name,
                default=None,
                metavar=_metavar(hints[f.name]),
                help=f"{f.metadata.get('doc', '')} [default: {default}]",
                **flag_value,  # type: ignore[arg-type]
            )(fn)
        return fn

    return decorate


def _metavar(hint: object) -> str:
    if typing.get_origin(hint) is Literal:
        return "|".join(str(a) for a in typing.get_args(hint))
    names: dict[object, str] = {int: "N", float: "X", bool: "true|false", Path: "DIR", str: "TEXT"}
    return names.get(hint, "TEXT")


def load(cls: type[T], config_file: Path | None, section: str, values: dict[str, Any]) -> T:
    """``cls`` from the ``[section]`` of ``config_file`` with command-line ``values`` on top."""
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    source = f"[{section}] of {config_file}" if config_file else "command line"
    return build_config(cls, merged(config_file, section, {k: v for k, v in values.items() if k in names}), source)


def config_file_option(help_text: str) -> Callable[[F], F]:
    """``--config FILE``: a TOML file; ``help_text`` says which of its tables the command reads."""
    return click.option(
        "--config",
        "config_file",
        type=click.Path(dir_okay=False, path_type=Path),
        default=None,
        help=f"TOML file: {help_text}; command-line options win.",
    )
