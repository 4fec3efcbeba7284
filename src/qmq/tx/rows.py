"""The statements on an outbox table, shared by the producers (sync and asyncio) and the watchdog.

Each function builds a statement once for a table; values go in as bound parameters, so
SQLAlchemy compiles each statement once and caches it.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import sqlalchemy as sa

from qmq.common.errors import printable_text
from qmq.tx.schema import STATUS_BLOCKED, STATUS_PENDING, truncate_error


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One outbox row as a watchdog or ``qmq watchdog --list-blocked`` sees it."""

    id: int
    message_id: str
    subject: str
    content: bytes
    created_ms: int
    attempts: int
    status: str
    next_attempt_ms: int
    last_error: str | None

    @property
    def created_at(self) -> datetime:
        return datetime.fromtimestamp(self.created_ms / 1000, tz=UTC)


def row_values(message_id: str, subject: str, content: bytes, now_ms: int) -> dict[str, Any]:
    """The values of a new pending row."""
    return {
        "message_id": message_id,
        "subject": subject,
        "content": content,
        "created_ms": now_ms,
        "attempts": 0,
        "status": STATUS_PENDING,
        "next_attempt_ms": now_ms,
    }


def delete_rows(table: sa.Table) -> sa.Delete:
    """Delete rows by id; parameter ``ids`` (a list)."""
    return table.delete().where(table.c.id.in_(sa.bindparam("ids", expanding=True)))


def record_failure(table: sa.Table) -> sa.Update:
    """The application's own send failed: count it; parameters ``row_id``, ``error``."""
    return (
        table.update()
        .where(table.c.id == sa.bindparam("row_id"))
        .values(attempts=table.c.attempts + 1, last_error=sa.bindparam("error"))
    )


def failure_params(row_id: int, error: BaseException | str) -> dict[str, Any]:
    """The row's failure as stored: valid UTF-8 text whatever the error held (a database
    driver refuses lone surrogates), even when the exception's own text cannot be read."""
    if isinstance(error, str):
        text = printable_text(error)
    else:
        try:
            text = printable_text(str(error)) or type(error).__name__
        except Exception:  # an exception whose __str__ itself fails
            text = f"{type(error).__name__} (its text could not be read)"
    return {"row_id": row_id, "error": truncate_error(text)}


def due_rows(table: sa.Table) -> sa.Select[Any]:
    """Pending rows old enough for a watchdog; parameters ``now``, ``cutoff``, ``limit``."""
    return (
        sa.select(table)
        .where(
            table.c.status == STATUS_PENDING,
            table.c.next_attempt_ms <= sa.bindparam("now"),
            table.c.created_ms <= sa.bindparam("cutoff"),
        )
        .order_by(table.c.id)
        .limit(sa.bindparam("limit"))
    )


def claim_row(table: sa.Table) -> sa.Update:
    """Compare-and-set claim of one row by a watchdog; rowcount 1 means it is this watchdog's.

    Parameters ``row_id``, ``seen_attempts`` (as read), ``claim_until``. Pushing
    ``next_attempt_ms`` past the send keeps every other watchdog off the row meanwhile.
    """
    return (
        table.update()
        .where(
            table.c.id == sa.bindparam("row_id"),
            table.c.attempts == sa.bindparam("seen_attempts"),
            table.c.status == STATUS_PENDING,
        )
        .values(attempts=table.c.attempts + 1, next_attempt_ms=sa.bindparam("claim_until"))
    )


def after_failure(table: sa.Table) -> sa.Update:
    """A watchdog's send failed; parameters ``row_id``, ``error``, ``next_attempt``, ``new_status``."""
    return (
        table.update()
        .where(table.c.id == sa.bindparam("row_id"))
        .values(
            last_error=sa.bindparam("error"),
            next_attempt_ms=sa.bindparam("next_attempt"),
            status=sa.bindparam("new_status"),
        )
    )


def blocked_rows(table: sa.Table) -> sa.Select[Any]:
    """Blocked rows, oldest first; parameter ``limit``."""
    return sa.select(table).where(table.c.status == STATUS_BLOCKED).order_by(table.c.id).limit(sa.bindparam("limit"))


def unblock_rows(table: sa.Table, ids: list[int] | None) -> sa.Update:
    """Blocked rows (all, or those of ``ids``) back to pending, due now; parameter ``now``."""
    stmt = table.update().where(table.c.status == STATUS_BLOCKED)
    if ids is not None:
        stmt = stmt.where(table.c.id.in_(ids))
    return stmt.values(status=STATUS_PENDING, attempts=0, next_attempt_ms=sa.bindparam("now"))


def count_by_status(table: sa.Table) -> sa.Select[Any]:
    return sa.select(table.c.status, sa.func.count()).group_by(table.c.status)


def to_row(mapping: Any) -> OutboxRow:
    return OutboxRow(
        id=int(mapping["id"]),
        message_id=mapping["message_id"],
        subject=mapping["subject"],
        content=bytes(mapping["content"]),
        created_ms=int(mapping["created_ms"]),
        attempts=int(mapping["attempts"]),
        status=mapping["status"],
        next_attempt_ms=int(mapping["next_attempt_ms"]),
        last_error=mapping["last_error"],
    )
