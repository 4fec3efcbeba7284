"""Cancels in the delay store on a manual clock: what a cancel stops, that a cancelled message's
record never reaches memory when its bucket loads, and that recovery applies a cancel again
from the write-ahead log (before a checkpoint) or keeps it in the dispatch log (after one)."""

from __future__ import annotations

from pathlib import Path

from delayhelpers import T0_MS, append, fire, manual_clock, open_store

from qmq.delay.bucket import DISPATCH, IDS
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore

MINUTE = 60_000
PRELOAD = 5_000


def checkpoint(store: DelayStore) -> None:
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)


def test_a_cancelled_message_of_a_bucket_not_loaded_never_reaches_the_timer(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    sched = Scheduler(store, PRELOAD)
    due = T0_MS + 10 * MINUTE
    append(store, [("s", f"m{i}", due + i) for i in range(100)])
    assert store.cancel("m7", sched) == 1
    assert store.pending_total == 99
    assert store.cancel("m7", sched) == 0, "a second cancel finds nothing pending"
    assert store.cancel("never-sent", sched) == 0
    clock.advance(11 * MINUTE / 1000)
    sched.load_due(clock.now_ms())
    # what the loaded bucket keeps: one timer row per pending message, none for the cancelled one
    assert len(sched.timer) == 99
    assert 7 not in sched.timer.rows_of(due - due % MINUTE)["entry"].tolist()
    got = fire(sched, clock)
    assert sorted(got) == sorted(f"m{i}" for i in range(100) if i != 7)
    assert store.cancel("m8", sched) == 0, "a message handed over cannot be cancelled"
    store.close()


def test_a_cancel_in_a_loaded_bucket_stops_the_row_at_hand_over(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    sched = Scheduler(store, PRELOAD)
    append(store, [("s", "a", T0_MS + 2000), ("s", "b", T0_MS + 3000)])
    sched.load_due(clock.now_ms())
    assert store.buckets[T0_MS].loaded
    assert store.cancel("a", sched) == 1
    clock.advance(5)
    assert fire(sched, clock) == ["b"]
    assert store.buckets[T0_MS].pending == 0
    store.close()


def test_a_cancel_before_a_checkpoint_is_applied_again_from_the_write_ahead_log(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    checkpoint(store)
    due = T0_MS + 10 * MINUTE
    append(store, [("s", "x", due), ("s", "y", due + 1)])
    assert store.cancel("x", None) == 1
    append(store, [("s", "x", due + 2)])  # the same id sent again after the cancel: not cancelled
    dispatch_log = store.buckets[due].directory / DISPATCH
    store.close()  # no checkpoint: recovery replays the messages and the cancel from the log
    dispatch_log.unlink()  # never fsynced: a machine crash may lose it

    store = DelayStore(store.config, clock)
    report = store.open()
    assert report["entries_cancelled"] == 1
    sched = Scheduler(store, PRELOAD)
    clock.advance(11 * MINUTE / 1000)
    assert sorted(fire(sched, clock)) == ["x", "y"]
    store.close()


def test_a_cancel_covered_by_a_checkpoint_survives_in_the_dispatch_log(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    due = T0_MS + 10 * MINUTE
    append(store, [("s", "x", due), ("s", "y", due + 1)])
    assert store.cancel("x", None) == 1
    checkpoint(store)
    store.close()

    store = DelayStore(store.config, clock)
    report = store.open()
    assert report["entries_cancelled"] == 0
    assert report["pending"] == 1
    sched = Scheduler(store, PRELOAD)
    clock.advance(11 * MINUTE / 1000)
    assert fire(sched, clock) == ["y"]
    store.close()


def test_a_bucket_without_an_id_file_gets_one_rebuilt_from_its_records(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    due = T0_MS + 10 * MINUTE
    append(store, [("s", f"m{i}", due) for i in range(5)])
    checkpoint(store)
    bucket_dir = store.buckets[due].directory
    store.close()
    (bucket_dir / IDS).unlink()  # as a bucket written before id files existed

    store = DelayStore(store.config, clock)
    store.open()
    assert (bucket_dir / IDS).exists()
    assert store.cancel("m3", None) == 1
    store.close()


def test_a_search_on_the_worker_thread_misses_nothing_written_or_buffered_since(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, preload_ms=PRELOAD)
    due = T0_MS + 10 * MINUTE
    append(store, [("s", "x", due), ("s", "y", due + 1)])
    store.flush_buffers()
    job = store.cancel_search("x")  # what the buckets hold written now: searched by the job
    append(store, [("s", "x", due + 2)])
    store.flush_buffers()  # written after the snapshot
    append(store, [("s", "x", due + 3), ("s", "x", due + 5 * MINUTE)])  # buffered; and in a new bucket
    written = job()  # as the checkpoint thread runs it
    assert [w.found for w in written.values()] == [[0]]
    assert store.cancel("x", None, written) == 4
    assert store.pending_total == 1
    store.close()
