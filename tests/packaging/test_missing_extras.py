"""The `qmq` command when an extra is not installed: one line naming the extra, exit 1, no
traceback; --help still works. Modules are hidden from ``importlib.util.find_spec`` here;
tests/packaging/test_install.py checks the same in a venv that really lacks them."""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from importlib.machinery import ModuleSpec

import click
import pytest
from click.testing import CliRunner

import qmq.__main__
from qmq.cli.main import COMMAND_EXTRAS, EXTRA_MODULES, QmqGroup, cli, register_commands


def _hide(monkeypatch: pytest.MonkeyPatch, *hidden: str) -> None:
    real: Callable[..., ModuleSpec | None] = importlib.util.find_spec

    def find_spec(name: str, package: str | None = None) -> ModuleSpec | None:
        return None if name.partition(".")[0] in hidden else real(name, package)

    monkeypatch.setattr(importlib.util, "find_spec", find_spec)


@pytest.fixture(scope="module", autouse=True)
def _commands() -> None:
    register_commands()


def test_every_command_of_the_table_exists_and_every_extra_has_modules() -> None:
    for path in COMMAND_EXTRAS:
        group: click.Command | None = cli
        for name in path.split():
            assert isinstance(group, click.Group), path
            group = group.commands.get(name)
        assert group is not None, f"COMMAND_EXTRAS names `qmq {path}`, which does not exist"
    assert set(COMMAND_EXTRAS.values()) == set(EXTRA_MODULES)


@pytest.mark.parametrize(
    ("argv", "hidden", "command", "extra"),
    [
        (["standalone"], "numpy", "standalone", "server"),
        (["broker", "--data-dir", "x"], "uvloop", "broker", "server"),
        (["cluster", "up", "--data-dir", "x"], "prometheus_client", "cluster up", "server"),
        (["archive", "--to", "x"], "pyarrow", "archive", "spark"),
        (["query", "--archive", "x"], "pyspark", "query", "spark"),
        (["trace", "--archive", "x", "--message-id", "1"], "pandas", "trace", "spark"),
        (["report", "--archive", "x"], "pyarrow", "report", "spark"),
        (["tx", "init", "--db", "sqlite://"], "sqlalchemy", "tx", "tx"),
        (["watchdog", "--db", "sqlite://"], "sqlalchemy", "watchdog", "tx"),
    ],
)
def test_a_command_without_its_extra_names_it_in_one_line_and_exits_1(
    monkeypatch: pytest.MonkeyPatch, argv: list[str], hidden: str, command: str, extra: str
) -> None:
    _hide(monkeypatch, hidden)
    result = CliRunner().invoke(cli, argv)
    assert result.exit_code == 1, result.output
    assert result.output == (
        f"qmq: error: `qmq {command}` needs the {extra} extra, which is not installed (no module {hidden!r}): "
        f"pip install 'qmq[{extra}]'\n"
    )


def test_help_and_other_commands_work_without_an_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide(monkeypatch, "numpy", "pyarrow", "sqlalchemy")
    for argv in (["standalone", "--help"], ["cluster", "up", "-h"], ["archive", "--help"], ["send", "--help"]):
        result = CliRunner().invoke(cli, argv)
        assert result.exit_code == 0, (argv, result.output)
        assert "Usage:" in result.output


def test_a_module_of_an_extra_missing_on_first_use_is_named_too() -> None:
    @click.group(cls=QmqGroup)
    def group() -> None:
        pass

    @group.command()
    def export() -> None:
        raise ModuleNotFoundError("No module named 'pyarrow'", name="pyarrow")

    @group.command()
    def other() -> None:
        raise ModuleNotFoundError("No module named 'nothing_of_qmq'", name="nothing_of_qmq")

    result = CliRunner().invoke(group, ["export"])
    assert (result.exit_code, result.output) == (
        1,
        "qmq: error: `qmq export` needs the spark extra, which is not installed (no module 'pyarrow'): "
        "pip install 'qmq[spark]'\n",
    )
    # a module no extra brings is a bug, not an install to make: its traceback stays
    result = CliRunner().invoke(group, ["other"])
    assert isinstance(result.exception, ModuleNotFoundError)


def test_the_console_script_without_click_names_the_cli_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _hide(monkeypatch, "click")
    with pytest.raises(SystemExit) as exited:
        qmq.__main__.main()
    assert exited.value.code == 1
    err = capsys.readouterr().err
    assert err.startswith("qmq: error: the qmq command needs the cli extra")
    assert "pip install 'qmq[cli]'" in err
    assert len(err.splitlines()) == 1
