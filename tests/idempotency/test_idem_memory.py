"""The in-memory checker, and what every checker shares: record keys, outcomes, claims."""

from __future__ import annotations

import threading

import pytest

from qmq.client.message import Message
from qmq.common.clock import ManualClock
from qmq.common.errors import ConfigError
from qmq.idempotency import MemoryIdempotentChecker, MessageInProgressError, Outcome
from qmq.idempotency.base import RecordKeys


class Boom(Exception):
    """A handler's failure."""


def test_duplicates_skipped_failures_not_recorded() -> None:
    checker = MemoryIdempotentChecker()
    m = Message("orders.paid")
    calls: list[str] = []

    def fail(msg: Message) -> None:
        calls.append("failed")
        raise Boom

    with pytest.raises(Boom):
        checker.run(m, fail)
    assert checker.run(m, lambda msg: calls.append("done")) is Outcome.PROCESSED
    assert checker.run(m, lambda msg: calls.append("again")) is Outcome.DUPLICATE
    assert calls == ["failed", "done"]


def test_ttl_and_max_entries(clock: ManualClock) -> None:
    checker = MemoryIdempotentChecker(max_entries=3, ttl_ms=1_000, clock=clock)
    messages = [Message("s", message_id=f"m{i}") for i in range(4)]
    for m in messages:
        assert checker.run(m, lambda msg: None) is Outcome.PROCESSED
    assert len(checker) == 3, "bounded: the oldest record went"
    assert checker.run(messages[0], lambda msg: None) is Outcome.PROCESSED
    assert checker.run(messages[3], lambda msg: None) is Outcome.DUPLICATE
    clock.advance(1.001)
    assert checker.run(messages[3], lambda msg: None) is Outcome.PROCESSED, "forgotten after ttl_ms"


def test_a_second_delivery_meanwhile_is_in_progress(clock: ManualClock) -> None:
    checker = MemoryIdempotentChecker(lease_ms=5_000, clock=clock)
    m = Message("s")
    inside, release = threading.Event(), threading.Event()
    results: list[Outcome] = []

    def slow(msg: Message) -> None:
        inside.set()
        assert release.wait(10)

    worker = threading.Thread(target=lambda: results.append(checker.run(m, slow)))
    worker.start()
    assert inside.wait(10)
    with pytest.raises(MessageInProgressError, match="being processed by another consumer") as info:
        checker.run(m, lambda msg: None)
    assert info.value.retriable
    release.set()
    worker.join(10)
    assert results == [Outcome.PROCESSED]
    assert checker.run(m, lambda msg: None) is Outcome.DUPLICATE


def test_a_dead_claim_expires_with_its_lease(clock: ManualClock) -> None:
    checker = MemoryIdempotentChecker(lease_ms=1_000, clock=clock)
    m = Message("s")
    checker._store.claim(checker._keys.of(m), "a-consumer-that-died")
    with pytest.raises(MessageInProgressError):
        checker.run(m, lambda msg: None)
    clock.advance(1.001)
    assert checker.run(m, lambda msg: None) is Outcome.PROCESSED


async def test_run_async() -> None:
    checker = MemoryIdempotentChecker()
    m = Message("s")
    seen: list[str] = []

    async def handle(msg: Message) -> None:
        seen.append(msg.message_id)

    async def fail(msg: Message) -> None:
        raise Boom

    with pytest.raises(Boom):
        await checker.run_async(m, fail)
    assert await checker.run_async(m, handle) is Outcome.PROCESSED
    assert await checker.run_async(m, handle) is Outcome.DUPLICATE
    assert seen == [m.message_id]


def test_record_keys() -> None:
    m = Message("orders.paid", message_id="id-1", properties={"orderId": "42"})
    assert RecordKeys(None, None).of(m) == "orders.paid/id-1"
    assert RecordKeys(None, "billing").of(m) == "billing/orders.paid/id-1"
    by_order = RecordKeys(lambda msg: str(msg.get_property("orderId")), None)
    assert by_order.of(m) == "orders.paid/42"
    long_key = RecordKeys(lambda msg: "x" * 300, "g").of(m)
    assert long_key.startswith("sha256:")
    assert len(long_key) == 71
    with pytest.raises(ConfigError, match="key function returned '' for message id-1"):
        RecordKeys(lambda msg: "", None).of(m)
    with pytest.raises(ConfigError, match="group"):
        RecordKeys(None, "has space")
    with pytest.raises(ConfigError, match="key=42 must be a function"):
        RecordKeys(42, None)  # type: ignore[arg-type]


def test_bad_options_are_named() -> None:
    with pytest.raises(ConfigError, match="max_entries=0"):
        MemoryIdempotentChecker(max_entries=0)
    with pytest.raises(ConfigError, match="ttl_ms=-1"):
        MemoryIdempotentChecker(ttl_ms=-1)
