"""One local SparkSession for every Spark test (bound to 127.0.0.1, UI off), and helpers."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark.sql import SparkSession

from qmq.spark.session import build_session
from qmq.testing import ReadyProcess

# local[2, 4]: two cores, and a failed task is tried up to four times (the retried-write test)
TEST_MASTER = "local[2,4]"


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    session = build_session(
        TEST_MASTER,
        app_name="qmq-tests",
        conf={
            "spark.sql.shuffle.partitions": "2",
            # a test session lives a minute: a quicker JIT and a simple GC start faster
            "spark.driver.extraJavaOptions": "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
        },
    )
    yield session
    session.stop()


@pytest.fixture
def data_dir(shared_standalone: ReadyProcess) -> str:
    """The shared standalone's data directory (the broker's files are under broker/)."""
    return str(Path(shared_standalone.ready["data_dir"]))
