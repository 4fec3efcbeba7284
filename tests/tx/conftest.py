"""Fixtures of the outbox tests: a fresh database of each kind per test, dropped afterwards."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from scratch_dbs import KINDS, Database, fresh_database


@pytest.fixture(params=KINDS)
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh, empty database: SQLite, PostgreSQL and MariaDB in turn."""
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture(params=["postgresql", "mariadb"])
def server_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    """A fresh database on a server (where concurrent writers really run at once)."""
    yield from fresh_database(request.param, tmp_path)


@pytest.fixture
def pg(tmp_path: Path) -> Iterator[Database]:
    """A fresh PostgreSQL database."""
    yield from fresh_database("postgresql", tmp_path)


@pytest.fixture
def engine(db: Database) -> Iterator[sa.Engine]:
    e = db.engine()
    yield e
    e.dispose()
