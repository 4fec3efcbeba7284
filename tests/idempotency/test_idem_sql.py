"""The SQL checker (records apart from the handler's work) on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import contextlib
import threading

import pytest
import sqlalchemy as sa

from qmq.client.message import Message
from qmq.common.clock import ManualClock
from qmq.idempotency import MessageInProgressError, Outcome, SqlIdempotentChecker


class Boom(Exception):
    """A handler's failure."""


def _records(engine: sa.Engine, table: str = "qmq_deduplication") -> dict[str, str]:
    with engine.connect() as conn:
        return {str(k): str(v) for k, v in conn.execute(sa.text(f"SELECT record_key, state FROM {table}"))}


def test_duplicates_skipped_failures_not_recorded(engine: sa.Engine, clock: ManualClock) -> None:
    checker = SqlIdempotentChecker(engine, clock=clock)
    m = Message("orders.paid", message_id="Order-1")
    calls: list[str] = []

    def fail(msg: Message) -> None:
        calls.append("failed")
        raise Boom

    with pytest.raises(Boom):
        checker.run(m, fail)
    assert _records(engine) == {}, "a failed handler leaves no record"
    assert checker.run(m, lambda msg: calls.append("done")) is Outcome.PROCESSED
    assert checker.run(m, lambda msg: calls.append("again")) is Outcome.DUPLICATE
    # Keys are compared exactly (MySQL's default collation would not).
    assert checker.run(Message("orders.paid", message_id="order-1"), lambda msg: None) is Outcome.PROCESSED
    assert calls == ["failed", "done"]
    assert _records(engine) == {"orders.paid/Order-1": "done", "orders.paid/order-1": "done"}


def test_a_second_delivery_meanwhile_is_in_progress(engine: sa.Engine) -> None:
    checker = SqlIdempotentChecker(engine)
    m = Message("s")
    inside, release = threading.Event(), threading.Event()
    results: list[Outcome] = []

    def slow(msg: Message) -> None:
        inside.set()
        assert release.wait(10)

    worker = threading.Thread(target=lambda: results.append(checker.run(m, slow)))
    worker.start()
    try:
        assert inside.wait(10)
        with pytest.raises(MessageInProgressError):
            checker.run(m, lambda msg: None)
    finally:
        release.set()
        worker.join(10)
    assert results == [Outcome.PROCESSED]
    assert checker.run(m, lambda msg: None) is Outcome.DUPLICATE


def test_a_dead_claim_expires_and_records_expire(engine: sa.Engine, clock: ManualClock) -> None:
    checker = SqlIdempotentChecker(engine, lease_ms=1_000, ttl_ms=60_000, purge_interval_ms=1, clock=clock)
    dead = Message("s", message_id="dead")
    checker._store.claim(checker._keys.of(dead), "a-consumer-that-died")
    with pytest.raises(MessageInProgressError):
        checker.run(dead, lambda msg: None)
    clock.advance(1.001)
    assert checker.run(dead, lambda msg: None) is Outcome.PROCESSED
    assert checker.run(dead, lambda msg: None) is Outcome.DUPLICATE
    clock.advance(60.001)
    assert checker.purge_if_due() == 1
    assert _records(engine) == {}
    assert checker.run(dead, lambda msg: None) is Outcome.PROCESSED, "forgotten after ttl_ms"


def test_groups_sharing_a_table_stay_apart(engine: sa.Engine) -> None:
    billing = SqlIdempotentChecker(engine, group="billing", table="shared_dedup")
    shipping = SqlIdempotentChecker(engine, group="shipping", table="shared_dedup")
    m = Message("orders.paid")
    assert billing.run(m, lambda msg: None) is Outcome.PROCESSED
    assert shipping.run(m, lambda msg: None) is Outcome.PROCESSED
    assert shipping.run(m, lambda msg: None) is Outcome.DUPLICATE
    assert sorted(_records(engine, "shared_dedup")) == [
        f"billing/orders.paid/{m.message_id}",
        f"shipping/orders.paid/{m.message_id}",
    ]


def test_many_consumers_apply_each_message_once(engine: sa.Engine) -> None:
    # Four threads race through the same twenty messages: each is applied by exactly one.
    checker = SqlIdempotentChecker(engine)
    messages = [Message("s", message_id=f"m{i}") for i in range(20)]
    applied: list[str] = []
    lock = threading.Lock()

    def apply(msg: Message) -> None:
        with lock:
            applied.append(msg.message_id)

    def consume() -> None:
        for m in messages:
            # In progress elsewhere: that thread applies it and records it done.
            with contextlib.suppress(MessageInProgressError):
                checker.run(m, apply)

    threads = [threading.Thread(target=consume) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert sorted(applied) == sorted(m.message_id for m in messages)
