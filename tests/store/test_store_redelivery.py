"""Moving a silent consumer's unacked messages to retry: one bad message or consumer never
stops the redelivery of the others."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from conftest import append, batch, flush
from qmq.common.clock import ManualClock
from qmq.protocol.message import TIMES_MAX, decode_message, encode_message
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.store.broker_store import BrokerStore
from qmq.store.consume_log import ConsumeLog
from qmq.store.redelivery import expire_silent_consumers

OFFLINE_MS = 1_000


def pulled_then_silent(store: BrokerStore, subject: str) -> None:
    gp = store.group(subject, "g", "earliest")
    assert store.pull(gp, gp.consumer("c"), "x", 100) is not None


def retried(store: BrokerStore, subject: str) -> list[str]:
    """Message ids stored on ``subject``, read outside any group."""
    _first, _count, chunks = store.read_range(subject, 0, 100)
    data = b"".join(chunks)
    out = []
    pos = 0
    while pos < len(data):
        h = read_record_header(data, pos)
        assert h is not None
        out.append(decode_message(data, pos + RECORD_HEADER_BYTES, h.length).message_id)
        pos += RECORD_HEADER_BYTES + h.length
    return out


def test_a_message_at_the_largest_attempt_count_goes_to_the_dead_letters_and_the_rest_are_retried(
    open_store: Callable[..., BrokerStore], clock: ManualClock
) -> None:
    store = open_store()
    # stored before the broker refused such sends at the door: the attempt count cannot grow
    poison = encode_message(b"poison", b"p1", b"", 0, b"", b"x", 1, times=TIMES_MAX)
    append(store, poison + batch("poison", ["p2"]))
    append(store, batch("q", ["q1", "q2", "q3"]))
    flush(store)
    pulled_then_silent(store, "poison")  # its group comes first in every round
    pulled_then_silent(store, "q")
    clock.advance(OFFLINE_MS)

    assert expire_silent_consumers(store, clock.now_ms(), OFFLINE_MS) == 5
    flush(store)
    assert retried(store, "%RETRY%q%g") == ["q1", "q2", "q3"]
    assert retried(store, "%RETRY%poison%g") == ["p2"]
    [letter] = store.dead.letters("%DEAD_RETRY%poison%g")
    described = letter.describe()
    assert described["message_id"] == "p1"
    assert described["attempts"] == TIMES_MAX  # it cannot be given another attempt: dead, as past max_retries
    assert store.redelivery_problems.messages_set_aside == 0
    # done with: the next round moves nothing again
    assert expire_silent_consumers(store, clock.now_ms(), OFFLINE_MS) == 0


def test_a_consumer_whose_messages_cannot_be_read_does_not_stop_the_others(
    open_store: Callable[..., BrokerStore], clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    append(store, batch("broken", ["b1"]))
    append(store, batch("q", ["q1"]))
    flush(store)
    pulled_then_silent(store, "broken")
    pulled_then_silent(store, "q")
    clock.advance(OFFLINE_MS)
    real_read = ConsumeLog.read

    def read(self: ConsumeLog, seq: int, count: int) -> bytes:
        if self.subject == "broken":
            raise OSError(5, "Input/output error")
        return real_read(self, seq, count)

    monkeypatch.setattr(ConsumeLog, "read", read)
    assert expire_silent_consumers(store, clock.now_ms(), OFFLINE_MS) == 1
    assert store.redelivery_problems.consumers_failed == 1
    monkeypatch.undo()
    assert expire_silent_consumers(store, clock.now_ms(), OFFLINE_MS) == 1  # tried again
    flush(store)
    assert retried(store, "%RETRY%broken%g") == ["b1"]
    assert retried(store, "%RETRY%q%g") == ["q1"]
