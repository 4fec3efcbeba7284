"""Repeating delay messages in the store on a manual clock: one send becomes its copies (due one
interval apart, numbered in the header and a property, the repeat flag cleared), cancelled as
one; every bound refused naming it; and a broker's duplicate window that tells copies apart
but still drops a copy handed over twice."""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from pathlib import Path

import msgpack
import pytest
from delayhelpers import T0_MS, manual_clock, open_store

from qmq.client.message import Message
from qmq.common.errors import InvalidMessageError
from qmq.delay.scheduler import Scheduler
from qmq.protocol.message import (
    FLAG_REPEAT,
    HEADER,
    REPEAT_COPY_PROPERTY,
    REPEAT_EVERY_PROPERTY,
    REPEAT_TIMES_PROPERTY,
    decode_message,
    decode_properties,
    encode_message,
    scan_batch,
)
from qmq.store.dedup import dedup_key

SECOND = 1000


def repeating(message_id: str, first_ms: int, every_ms: int, times: int, body: bytes = b"tick") -> bytes:
    """A repeating message as the SDK encodes it (header flag and two properties)."""
    props = msgpack.packb({"k": "v", REPEAT_EVERY_PROPERTY: every_ms, REPEAT_TIMES_PROPERTY: times})
    raw = bytearray(encode_message(b"s", message_id.encode(), b"", 0, props, body, T0_MS, first_ms))
    raw[1] |= FLAG_REPEAT
    return bytes(raw)


def test_one_send_becomes_its_copies_numbered_and_cancelled_as_one(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=5_000)
    frame = repeating("r", T0_MS + 10 * SECOND, 2 * SECOND, 5)
    result = store.append(frame, scan_batch(frame))
    assert result.errors == []
    assert result.stored == 5
    assert store.pending_total == 5
    sched = Scheduler(store, 5_000)
    clock.advance(30)
    sched.load_due(clock.now_ms())
    rows = sched.take(clock.now_ms(), 100, 1 << 30)
    handover = sched.read(rows)
    copies = [decode_message(e) for e in handover.encoded]
    assert [c.deliver_at_ms for c in copies] == [T0_MS + 10 * SECOND + k * 2 * SECOND for k in range(5)]
    assert {c.message_id for c in copies} == {"r"}
    for k, c in enumerate(copies, start=1):
        header = HEADER.unpack_from(e := handover.encoded[k - 1], 0)
        assert header[1] & FLAG_REPEAT == 0, "a copy must never be repeated again"
        assert header[9] == k  # the copy field
        props = decode_properties(c.properties_raw)
        assert props[REPEAT_COPY_PROPERTY] == k
        assert props["k"] == "v"
        assert c.body == b"tick"
        assert scan_batch(e)[0].copy == k
    store.close()


def test_the_copies_of_a_repeating_message_are_cancelled_together(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=5_000)
    frame = repeating("r", T0_MS + 10 * SECOND, 30 * SECOND, 6)  # over several one-minute buckets
    store.append(frame, scan_batch(frame))
    assert store.cancel("r", None) == 6
    assert store.pending_total == 0
    store.close()


@pytest.mark.parametrize(
    ("every_ms", "times", "first_ms", "bound"),
    [
        (999, 3, T0_MS + SECOND, "under the least interval, 1000 ms"),
        (SECOND, 10_001, T0_MS + SECOND, "outside 1..10000"),
        (SECOND, 0, T0_MS + SECOND, "outside 1..10000"),
        (86_400_000, 10, T0_MS + 725 * 86_400_000, "the horizon is 730 days"),
    ],
)
def test_a_repeat_past_a_bound_is_refused_naming_it(
    tmp_path: Path, every_ms: int, times: int, first_ms: int, bound: str
) -> None:
    store = open_store(tmp_path, manual_clock())
    frame = repeating("r", first_ms, every_ms, times)
    result = store.append(frame, scan_batch(frame))
    assert result.stored == 0
    assert bound in result.errors[0][2], result.errors
    store.close()


def test_copies_of_one_send_are_bounded_in_bytes(tmp_path: Path) -> None:
    store = open_store(tmp_path, manual_clock())
    frame = repeating("r", T0_MS + SECOND, SECOND, 10_000, body=b"x" * 8192)
    result = store.append(frame, scan_batch(frame))
    assert result.stored == 0
    assert "64 MiB the copies of one send may take" in result.errors[0][2]
    store.close()


def test_the_duplicate_window_tells_copies_apart_but_not_a_copy_from_itself() -> None:
    def copy(k: int, times: int = 1) -> bytes:
        return (
            encode_message(b"s", b"id", b"", 0, b"", b"", T0_MS, T0_MS, times)[:26]
            + k.to_bytes(2, "little")
            + (encode_message(b"s", b"id", b"", 0, b"", b"", T0_MS, T0_MS, times)[28:])
        )

    first, second, first_again = (dedup_key(scan_batch(copy(k))[0]) for k in (1, 2, 1))
    assert first != second
    assert first == first_again, "a copy handed over twice must be dropped as a repeat"
    plain = dedup_key(scan_batch(copy(0))[0])
    assert plain not in (first, second)


def test_set_repeat_checks_its_bounds_at_once() -> None:
    m = Message("s")
    with pytest.raises(InvalidMessageError, match="least interval, 1 s"):
        m.set_repeat(every=0.5, times=3)
    with pytest.raises(InvalidMessageError, match=r"outside 1\.\.10000"):
        m.set_repeat(every=timedelta(seconds=1), times=10_001)
    with pytest.raises(InvalidMessageError, match="one end"):
        m.set_repeat(every=1, times=3, until=datetime.now(UTC))
    with pytest.raises(InvalidMessageError, match="aware datetime"):
        m.set_repeat(every=1, until=datetime(2030, 1, 1))
    m.set_repeat(every=1, until=datetime.now(UTC) + timedelta(days=1))
    with pytest.raises(InvalidMessageError, match="86,400 copies; the most is 10,000"):
        m.encode()
    m.set_repeat(every=timedelta(minutes=1), until=datetime.now(UTC) + timedelta(minutes=10, seconds=30))
    fields = decode_message(m.encode())
    props = decode_properties(fields.properties_raw)
    assert props[REPEAT_TIMES_PROPERTY] == 10
    assert props[REPEAT_EVERY_PROPERTY] == 60_000


def test_the_first_copy_is_one_interval_after_the_send_or_at_the_due_time_given() -> None:
    m = Message("s")
    m.set_repeat(every=timedelta(seconds=30), times=2)
    before_ms = time.time_ns() // 1_000_000
    first_ms = decode_message(m.encode()).deliver_at_ms
    assert before_ms + 30_000 <= first_ms <= time.time_ns() // 1_000_000 + 30_000
    at = datetime.now(UTC) + timedelta(hours=1)
    m.set_deliver_at(at)
    assert decode_message(m.encode()).deliver_at_ms == m.deliver_at_ms
