"""Databases for tests that need one: a fresh, empty one of each kind per test, dropped afterwards.

A helper module, not a conftest: test modules import it by name (it sits beside them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa

# The servers every engineer's machine runs: trust auth, no password.
_ADMIN_URLS = {
    "postgresql": "postgresql+psycopg://postgres@127.0.0.1:5432/postgres",
    "mariadb": "mysql+pymysql://root@127.0.0.1:3306/",
}
KINDS = ("sqlite", "postgresql", "mariadb")


@dataclass(frozen=True, slots=True)
class Database:
    kind: str
    url: str

    @property
    def async_url(self) -> str:
        if self.kind == "sqlite":
            return self.url.replace("sqlite://", "sqlite+aiosqlite://", 1)
        if self.kind == "postgresql":
            return self.url.replace("postgresql+psycopg://", "postgresql+psycopg_async://", 1)
        raise ValueError(f"no asyncio driver installed for {self.kind}")

    def engine(self, **kw: Any) -> sa.Engine:
        return sa.create_engine(self.url, **kw)


_admins: dict[str, sa.Engine] = {}


def _admin(kind: str) -> sa.Engine:
    # One per process: creating an engine and its first connection costs more than the database.
    engine = _admins.get(kind)
    if engine is None:
        engine = _admins[kind] = sa.create_engine(_ADMIN_URLS[kind], isolation_level="AUTOCOMMIT")
    return engine


def fresh_database(kind: str, tmp_path: Path) -> Iterator[Database]:
    """A new database of ``kind`` ("sqlite", "postgresql" or "mariadb"), dropped afterwards.

    On PostgreSQL it is a schema of its own (made the connections' search_path): a
    CREATE DATABASE costs a quarter of a second there, a schema a few milliseconds.
    """
    if kind == "sqlite":
        yield Database(kind, f"sqlite:///{tmp_path / 'app.db'}")
        return
    name = f"qmq_test_{uuid.uuid4().hex[:12]}"
    admin = _admin(kind)
    if kind == "postgresql":
        with admin.connect() as conn:
            conn.execute(sa.text(f"CREATE SCHEMA {name}"))
        try:
            url = sa.make_url(_ADMIN_URLS[kind]).update_query_dict({"options": f"-csearch_path={name}"})
            yield Database(kind, url.render_as_string())
        finally:
            with admin.connect() as conn:
                conn.execute(sa.text(f"DROP SCHEMA IF EXISTS {name} CASCADE"))
        return
    charset = " CHARACTER SET utf8mb4" if kind == "mariadb" else ""
    with admin.connect() as conn:
        conn.execute(sa.text(f"CREATE DATABASE {name}{charset}"))
    try:
        yield Database(kind, sa.make_url(_ADMIN_URLS[kind]).set(database=name).render_as_string())
    finally:
        with admin.connect() as conn:
            conn.execute(sa.text(f"DROP DATABASE IF EXISTS {name}"))
