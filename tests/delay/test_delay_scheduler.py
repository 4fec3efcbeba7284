"""The scheduler on a manual clock: buckets load shortly before they start, messages fire in due
order and never early, buckets roll over, finished ones are deleted, and a restart reloads
what was not yet acknowledged."""

from __future__ import annotations

from array import array
from pathlib import Path

import numpy as np
import pytest
from delayhelpers import T0_MS, append, ids_of, manual_clock, open_store

from qmq.common.clock import ManualClock
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.protocol.message import decode_message

MINUTE = 60_000
PRELOAD = 5_000


def fire(sched: Scheduler, clock: ManualClock, ack: bool = True) -> list[str]:
    """Everything due now, handed over and (by default) acknowledged; returns message ids."""
    now = clock.now_ms()
    sched.load_due(now)
    rows = sched.take(now, 100_000, 1 << 40)
    handover = sched.read(rows)
    assert all(due <= now for due in handover.rows["due"].tolist())
    if ack:
        for start in np.unique(handover.rows["bucket"]).tolist():
            mine = handover.rows[handover.rows["bucket"] == start]
            sched.dispatched(int(start), array("I", mine["entry"].tolist()).tobytes())
    return ids_of(handover.encoded)


def checkpoint(store: DelayStore) -> None:
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)


def test_a_bucket_loads_only_within_the_preload_window_of_its_start(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "now", T0_MS + 1000), ("s", "next", T0_MS + MINUTE + 500)])
    sched.load_due(clock.now_ms())
    assert store.buckets[T0_MS].loaded
    assert not store.buckets[T0_MS + MINUTE].loaded
    assert sched.next_load_ms() == T0_MS + MINUTE - PRELOAD
    clock.advance((MINUTE - PRELOAD - 1) / 1000)
    sched.load_due(clock.now_ms())
    assert not store.buckets[T0_MS + MINUTE].loaded
    clock.advance(0.001)
    sched.load_due(clock.now_ms())
    assert store.buckets[T0_MS + MINUTE].loaded
    assert len(sched.timer) == 2
    store.close()


def test_messages_fire_in_due_order_and_never_before_they_are_due(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "c", T0_MS + 3000), ("s", "a", T0_MS + 1000), ("s", "b", T0_MS + 2000)])
    assert fire(sched, clock) == []
    clock.advance(1.999)
    assert fire(sched, clock) == ["a"]
    clock.advance(0.001)
    assert fire(sched, clock) == ["b"]
    clock.advance(5)
    assert fire(sched, clock) == ["c"]
    store.close()


def test_handed_over_bytes_are_the_producers_due_time_included(tmp_path: Path) -> None:
    """The broker holds a message handed over before it is due (qmq.store.held) by its due time."""
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("order.paid", "id-1", T0_MS + 10)], body=b"payload")
    clock.advance(0.01)
    sched.load_due(clock.now_ms())
    handover = sched.read(sched.take(clock.now_ms(), 10, 1 << 20))
    (raw,) = handover.encoded
    fields = decode_message(raw)
    assert (fields.subject, fields.message_id, fields.body, fields.times) == ("order.paid", "id-1", b"payload", 0)
    assert fields.deliver_at_ms == T0_MS + 10
    assert handover.subjects == ["order.paid"]
    assert handover.message_ids == ["id-1"]
    store.close()


def test_arrivals_for_a_loaded_bucket_join_the_timer(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "first", T0_MS + 5000)])
    sched.load_due(clock.now_ms())
    result = append(store, [("s", "late", T0_MS + 1000)])
    assert len(result.arrivals) == 1  # the bucket is loaded: the row goes to the timer now
    sched.timer.add(result.arrivals)
    clock.advance(10)
    assert fire(sched, clock) == ["late", "first"]
    store.close()


def test_rollover_to_the_next_bucket_and_deletion_of_finished_buckets(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", f"m{i}", T0_MS + i * 20_000) for i in range(6)])  # two minutes: two buckets
    assert store.starts == [T0_MS, T0_MS + MINUTE]
    fired: list[str] = []
    for _ in range(13):
        fired += fire(sched, clock)
        clock.advance(10)
    assert fired == [f"m{i}" for i in range(6)]
    # every message acknowledged, but nothing is deleted before a checkpoint covers it
    assert sched.remove_finished(clock.now_ms()) == []
    checkpoint(store)
    clock.advance(60)  # past the end of the second bucket
    assert sched.remove_finished(clock.now_ms()) == [T0_MS, T0_MS + MINUTE]
    assert store.buckets == {}
    assert list((tmp_path / "schedule").iterdir()) == []
    store.close()


def test_a_bucket_is_kept_while_a_message_in_it_is_unacknowledged(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "a", T0_MS + 1000)])
    clock.advance(2)
    assert fire(sched, clock, ack=False) == ["a"]
    checkpoint(store)
    clock.advance(120)
    assert sched.remove_finished(clock.now_ms()) == []
    store.close()


def test_a_restart_reloads_what_was_not_acknowledged(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", f"m{i}", T0_MS + 1000 * (i + 1)) for i in range(5)])
    clock.advance(2.5)
    assert fire(sched, clock) == ["m0", "m1"]
    clock.advance(1)
    assert fire(sched, clock, ack=False) == ["m2"]  # handed over, the process dies before the ack
    store.close()

    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    clock.advance(10)
    assert fire(sched, clock) == ["m2", "m3", "m4"]
    store.close()


def test_a_past_bucket_left_undispatched_is_loaded_at_start(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", "old", T0_MS + 30_000)])
    store.close()
    clock.advance(3600)  # down for an hour
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    assert fire(sched, clock) == ["old"]
    store.close()


def test_a_damaged_record_is_never_handed_over(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "good", T0_MS + 10), ("s", "bad", T0_MS + 20)], body=b"payload")
    store.flush_buffers()
    b = store.buckets[T0_MS]
    path = b.directory / "messages"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF  # flip a bit of the second record's body
    path.write_bytes(raw)
    clock.advance(1)
    sched.load_due(clock.now_ms())
    handover = sched.read(sched.take(clock.now_ms(), 10, 1 << 20))
    assert ids_of(handover.encoded) == ["good"]
    assert handover.corrupt["entry"].tolist() == [1]
    assert "fails its check" in caplog.text
    store.close()


def test_loading_in_two_steps_counts_arrivals_and_acks_made_meanwhile(tmp_path: Path) -> None:
    """A large bucket is read on a worker thread: messages arriving (and acknowledged) in between
    must neither be lost nor counted twice."""
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", f"old{i}", T0_MS + 1000 + i) for i in range(5)])
    b = store.buckets[T0_MS]
    job = sched.begin_load(b)
    arrived = append(store, [("s", "new0", T0_MS + 10), ("s", "new1", T0_MS + 20)])
    assert len(arrived.arrivals) == 2  # the bucket counts as loaded already: rows for the timer
    sched.timer.add(arrived.arrivals)
    clock.advance(0.015)
    assert fire(sched, clock) == ["new0"]  # handed over and acknowledged before the load ends
    job.run()
    assert sched.finish_load(job) == 5
    assert b.dispatched == 1
    clock.advance(2)
    assert fire(sched, clock) == ["new1", "old0", "old1", "old2", "old3", "old4"]
    assert b.dispatched == b.count == 7
    store.close()
