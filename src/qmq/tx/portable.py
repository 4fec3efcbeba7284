"""SQL that differs between the databases qmq's tables live in: one place that knows how.

Supported: PostgreSQL, MariaDB/MySQL and SQLite. Everything else in ``qmq.tx`` and
``qmq.idempotency`` is plain SQLAlchemy Core.
"""

from __future__ import annotations

import sqlalchemy as sa
from sqlalchemy.dialects import postgresql, sqlite

from qmq.common.errors import ConfigError

SUPPORTED_DIALECTS = ("postgresql", "mysql", "mariadb", "sqlite")


def check_dialect(engine: sa.Engine) -> str:
    """The dialect name of ``engine`` if qmq's tables support it; ConfigError otherwise."""
    name = engine.dialect.name
    if name not in SUPPORTED_DIALECTS:
        raise ConfigError(
            f"database {engine.url.render_as_string()!r} is {name}; qmq's outbox and deduplication "
            "tables support PostgreSQL, MariaDB/MySQL and SQLite"
        )
    return name


def insert_if_absent(table: sa.Table, dialect_name: str) -> sa.Insert:
    """An INSERT that leaves an existing row alone: rowcount 1 if it inserted, 0 if the key existed.

    While another transaction holds an uncommitted row with the same key, it waits for that
    transaction (all three databases do), so of two concurrent inserts exactly one wins.
    MySQL's ``INSERT IGNORE`` would also hide a value that does not fit; callers check
    their values first.
    """
    # SQLAlchemy reports an INSERT's rowcount only when asked to keep it.
    if dialect_name == "postgresql":
        return postgresql.insert(table).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
    if dialect_name == "sqlite":
        return sqlite.insert(table).on_conflict_do_nothing().execution_options(preserve_rowcount=True)
    if dialect_name in ("mysql", "mariadb"):
        return table.insert().prefix_with("IGNORE").execution_options(preserve_rowcount=True)
    raise ConfigError(f"database dialect {dialect_name!r} is not supported; use PostgreSQL, MariaDB/MySQL or SQLite")
