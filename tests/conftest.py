"""Fixtures shared by the whole suite: real qmq servers on port 0, unique subject names."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmq.testing import ReadyProcess, running_standalone


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
