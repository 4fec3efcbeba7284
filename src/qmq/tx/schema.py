"""The outbox tables: their columns, their names, and creating them.

SQLAlchemy Core tables, portable across PostgreSQL, MariaDB/MySQL and SQLite (the only
dialect-specific parts are column types: MySQL's BLOB holds 64 KiB, so the message column
is a MEDIUMBLOB there, and MySQL compares strings without case, so name columns use a
binary collation).

    qmq_msg_queue (name configurable)       one row per message sent in a transaction
        id               BIGINT, primary key, autoincrement
        message_id       the message's id (what the broker's duplicate window keys on)
        subject          the subject it is sent to
        content          the message exactly as the SDK encoded it (qmq.protocol.message)
        created_ms       when the application's transaction wrote it (epoch ms, app clock)
        attempts         sends tried and failed so far (by the application or a watchdog)
        status           'pending', or 'blocked' once attempts reached the watchdog's maximum
        next_attempt_ms  a watchdog sends the row again no earlier than this (epoch ms)
        last_error       why the last send failed (at most 1000 characters), or NULL
        index (status, next_attempt_ms): what a watchdog looks for

    qmq_watchdog_lease (name configurable)  which watchdog resends for an outbox table now
        name             the outbox table's name
        owner            the watchdog holding the lease (host-pid-random)
        expires_ms       the lease ends then unless renewed (epoch ms, watchdog clock)
"""

from __future__ import annotations

import functools
import re

import sqlalchemy as sa
from sqlalchemy.dialects import mysql

from qmq.common.errors import ConfigError

DEFAULT_OUTBOX_TABLE = "qmq_msg_queue"
DEFAULT_LEASE_TABLE = "qmq_watchdog_lease"

STATUS_PENDING = "pending"
STATUS_BLOCKED = "blocked"

# Room for a custom message id (128 characters) and an internal subject (255).
MESSAGE_ID_CHARS = 255
SUBJECT_CHARS = 255
OWNER_CHARS = 255
LAST_ERROR_CHARS = 1000
# PostgreSQL truncates identifiers past 63 bytes; refusing them is clearer.
_TABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,62}")
# The encoded message is at most message_bytes_max (4 MiB); MEDIUMBLOB holds 16 MiB.
_CONTENT = sa.LargeBinary().with_variant(mysql.MEDIUMBLOB(), "mysql", "mariadb")
# SQLite makes only an INTEGER PRIMARY KEY an autoincrementing rowid alias.
_ROW_ID = sa.BigInteger().with_variant(sa.Integer(), "sqlite")


def name_column(chars: int) -> sa.types.TypeEngine[str]:
    """A string compared exactly: MySQL's default collation would make 'A' and 'a' equal."""
    return sa.String(chars).with_variant(
        mysql.VARCHAR(chars, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


def check_table_name(name: object, option: str = "table") -> str:
    """``name`` if it is a plain SQL identifier; ConfigError naming it otherwise."""
    if not isinstance(name, str) or not _TABLE_NAME.fullmatch(name):
        raise ConfigError(
            f"{option}={name!r} is not a plain table name; use letters, digits and '_' "
            "(at most 63, not starting with a digit)"
        )
    return name


@functools.cache
def outbox_table(name: str) -> sa.Table:
    """The outbox table called ``name`` (one Table object per name, each in its own MetaData)."""
    check_table_name(name)
    table = sa.Table(
        name,
        sa.MetaData(),
        sa.Column("id", _ROW_ID, primary_key=True, autoincrement=True),
        sa.Column("message_id", name_column(MESSAGE_ID_CHARS), nullable=False),
        sa.Column("subject", name_column(SUBJECT_CHARS), nullable=False),
        sa.Column("content", _CONTENT, nullable=False),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
        sa.Column("attempts", sa.Integer, nullable=False, server_default=sa.text("0")),
        sa.Column("status", sa.String(16), nullable=False, server_default=STATUS_PENDING),
        sa.Column("next_attempt_ms", sa.BigInteger, nullable=False),
        sa.Column("last_error", sa.String(LAST_ERROR_CHARS), nullable=True),
    )
    sa.Index(f"ix_{name}_due"[:63], table.c.status, table.c.next_attempt_ms)
    return table


@functools.cache
def lease_table(name: str) -> sa.Table:
    """The watchdog lease table called ``name``."""
    check_table_name(name, "lease_table")
    return sa.Table(
        name,
        sa.MetaData(),
        sa.Column("name", name_column(255), primary_key=True),
        sa.Column("owner", name_column(OWNER_CHARS), nullable=False),
        sa.Column("expires_ms", sa.BigInteger, nullable=False),
    )


def create_outbox_tables(
    bind: sa.Engine | sa.Connection, table: str = DEFAULT_OUTBOX_TABLE, lease: str = DEFAULT_LEASE_TABLE
) -> None:
    """Create the outbox table and the watchdog lease table when absent (``qmq tx init``)."""
    outbox_table(table).metadata.create_all(bind, checkfirst=True)
    lease_table(lease).metadata.create_all(bind, checkfirst=True)


def truncate_error(text: str) -> str:
    return text if len(text) <= LAST_ERROR_CHARS else text[: LAST_ERROR_CHARS - 1] + "…"
