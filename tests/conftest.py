"""Fixtures shared by the whole suite: real qmq servers on port 0, unique subject names; the
reports of a test made fit for the worker processes of pytest-xdist (test.sh runs two); and
which tests share a worker there."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import aiohttp
import pytest
from xdist.remote import Producer
from xdist.scheduler import LoadFileScheduling

from qmq.testing import ReadyProcess, running_standalone

# Tests that run on one worker together under pytest-xdist (test.sh runs two workers): those of
# tests/spark share one Spark session (a JVM of its own, a minute to start on a loaded machine),
# which a second worker would start again. Every other module is a unit of its own, as with
# `--dist loadfile`: its tests run on one worker, in order, and its module fixtures start once.
_ONE_WORKER_DIRS = ("tests/spark/",)


def _unit(nodeid: str) -> str:
    """The unit of work a test belongs to: its directory in _ONE_WORKER_DIRS, else its module."""
    return next((d for d in _ONE_WORKER_DIRS if nodeid.startswith(d)), nodeid.split("::", 1)[0])


class TogetherScheduling(LoadFileScheduling):
    def _split_scope(self, nodeid: str) -> str:
        return _unit(nodeid)


def pytest_xdist_make_scheduler(config: pytest.Config, log: Producer) -> TogetherScheduling:
    return TogetherScheduling(config, log)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """On a worker, its collection is the order units are handed out in (with test.sh's
    --no-loadscope-reorder; else pytest-xdist orders them by their number of tests): the
    longest first, so that no long unit starts last and leaves the other worker idle at the
    end. The Spark tests, then every module with a slow test, then the rest; collection order
    within each."""
    if not hasattr(config, "workerinput"):
        return
    slow = {_unit(item.nodeid) for item in items if item.get_closest_marker("slow") is not None}

    def rank(item: pytest.Item) -> int:
        unit = _unit(item.nodeid)
        return 0 if unit in _ONE_WORKER_DIRS else 1 if unit in slow else 2

    items.sort(key=rank)


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
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client session for a test (a module that wants another timeout has its own)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as session:
        yield session


@pytest.fixture
def subject() -> str:
    return f"test.{uuid.uuid4().hex[:12]}"


@pytest.fixture
def standalone_dir(tmp_path: Path) -> Path:
    return tmp_path / "qmq-data"
