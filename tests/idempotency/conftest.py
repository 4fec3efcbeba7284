"""Fixtures of the idempotency tests: a fresh database of each kind, a Redis key prefix, a clock."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import sqlalchemy as sa

from qmq.common.clock import ManualClock
from scratch_dbs import KINDS, Database, fresh_database


@pytest.fixture(params=KINDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh, empty database: SQLite, PostgreSQL and MariaDB in turn."""
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture(params=["postgresql", "mariadb"])
def server_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh database on a server, where concurrent transactions really run at once."""
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture
def engine(db: Database) -> Iterator[sa.Engine]:
    e = db.engine()
    yield e
    e.dispose()


@pytest.fixture
def redis_client() -> Iterator[redis.Redis]:
    client = redis.Redis(host="127.0.0.1", port=6379)
    yield client
    client.close()


@pytest.fixture
def redis_prefix(redis_client: redis.Redis) -> Iterator[str]:
    """A key prefix of this test's own; its keys are deleted afterwards."""
    prefix = f"qmq-test:{uuid.uuid4().hex[:12]}:"
    yield prefix
    keys = list(redis_client.scan_iter(match=prefix + "*", count=1000))
    if keys:
        redis_client.delete(*keys)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=int(time.time() * 1000))
