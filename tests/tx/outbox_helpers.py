"""Helpers of the outbox tests: consuming a subject until a count with a deadline, outbox rows
left behind as a crashed application would leave them, and waiting on a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

import sqlalchemy as sa

from qmq.client.message import Message
from qmq.client.sync import Consumer
from qmq.tx.rows import row_values
from qmq.tx.schema import DEFAULT_OUTBOX_TABLE, outbox_table

# After the expected messages came, one more pull this long shows a duplicate would have come too.
EXTRA_PULL_MS = 300


def consume(meta_server: str, subject: str, count: int, timeout_s: float = 20.0) -> list[tuple[str, bytes]]:
    """(message id, body) of every message of ``subject`` from the earliest, until ``count`` came."""
    got: list[tuple[str, bytes]] = []
    with Consumer(app_code="tx-tests", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, "tx-tests", start_from="earliest")
        deadline = time.monotonic() + timeout_s
        while len(got) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"only {len(got)} of {count} messages of {subject} came within {timeout_s} s")
            batch = pull.pull(max_messages=500, timeout_ms=1000)
            got.extend((m.message_id, m.body) for m in batch)
            batch.ack_all()
        extra = pull.pull(max_messages=500, timeout_ms=EXTRA_PULL_MS)
        got.extend((m.message_id, m.body) for m in extra)
        extra.ack_all()
    return got


def wait_until(condition: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.02)  # polling a condition, bounded by the deadline


def outbox_rows(engine: sa.Engine, table: str = DEFAULT_OUTBOX_TABLE) -> int:
    with engine.connect() as conn:
        return int(conn.scalar(sa.select(sa.func.count()).select_from(outbox_table(table))) or 0)


def leave_rows(engine: sa.Engine, messages: list[Message], created_ms: int, table: str = DEFAULT_OUTBOX_TABLE) -> None:
    """Outbox rows of committed messages whose after-commit send never happened (a crash)."""
    with engine.begin() as conn:
        conn.execute(
            outbox_table(table).insert(),
            [row_values(m.message_id, m.subject, m.encode(), created_ms) for m in messages],
        )
