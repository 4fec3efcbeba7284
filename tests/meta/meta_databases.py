"""Databases for the meta tests: a fresh, empty one of each kind the store supports.

A helper module, not a conftest: test modules import it by name (it sits beside them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from qmq.meta.store import sqlite_url

# The servers every engineer's machine runs: trust auth, no password.
_ADMIN_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/",
}


@dataclass(frozen=True, slots=True)
class Database:
    """A database made for one test; ``drop()`` removes it even while the store is connected."""

    kind: str
    url: str
    name: str

    def drop(self) -> None:
        if self.kind == "sqlite":
            raise ValueError("a SQLite test database is a file; delete it instead")
        force = " WITH (FORCE)" if self.kind == "postgresql" else ""
        admin = sa.create_engine(_ADMIN_URLS[self.kind], isolation_level="AUTOCOMMIT")
        try:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP DATABASE IF EXISTS {self.name}{force}"))
        finally:
            admin.dispose()


@contextmanager
def fresh_database(kind: str, tmp_path: Path) -> Iterator[Database]:
    """A new database of ``kind`` ("sqlite", "postgresql" or "mariadb"), dropped on exit."""
    if kind == "sqlite":
        yield Database(kind, sqlite_url(tmp_path / "meta"), "meta.db")
        return
    name = f"qmq_meta_test_{uuid.uuid4().hex[:12]}"
    charset = " CHARACTER SET utf8mb4" if kind == "mariadb" else ""
    admin = sa.create_engine(_ADMIN_URLS[kind], isolation_level="AUTOCOMMIT")
    try:
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE DATABASE {name}{charset}"))
    finally:
        admin.dispose()
    db = Database(kind, sa.make_url(_ADMIN_URLS[kind]).set(database=name).render_as_string(), name)
    try:
        yield db
    finally:
        db.drop()
