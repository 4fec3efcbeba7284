"""Fixtures shared by the whole suite: real qmq servers on port 0, unique subject names; and the
reports of a test made fit for the worker processes of pytest-xdist (test.sh runs two)."""

from __future__ import annotations

import uuid
from collections.abc import Generator, Iterator
from pathlib import Path

import pytest

from qmq.testing import ReadyProcess, running_standalone


def _utf8(text: str) -> str:
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, pytest.TestReport]:
    """A worker sends its reports to the controller as UTF-8: a lone surrogate in a test's captured
    output (a log line quoting ``os.fsdecode`` of a non-UTF-8 path) would end the worker and leave
    the rest of its tests unrun. Such characters are escaped (``\\udcff``) in the report."""
    report = yield
    report.sections = [(title, _utf8(content)) for title, content in report.sections]
    if report.longrepr is not None and _utf8(str(report.longrepr)) != str(report.longrepr):
        report.longrepr = _utf8(str(report.longrepr))
    return report


@pytest.fixture(scope="session")
def shared_standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    """One `qmq standalone` for tests that only need a working server; use unique subjects with it."""
    data_dir = tmp_path_factory.mktemp("shared") / "qmq-data"
    with running_standalone(data_dir, {"broker": {"checkpoint_interval_ms": 500}}) as proc:
        yield proc


@pytest.fixture
def meta_server(shared_standalone: ReadyProcess) -> str:
    return shared_standalone.meta_server


@pytest.fixture
def subject() -> str:
    return f"test.{uuid.uuid4().hex[:12]}"


@pytest.fixture
def standalone_dir(tmp_path: Path) -> Path:
    return tmp_path / "qmq-data"
