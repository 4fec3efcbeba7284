"""The delay store's parts alone, without a DelayStore: the messages of far buckets waiting for
a flush, the checkpoint's contents byte by byte, the schedule of time buckets, the scheduler
on a schedule, and recovery building the parts from a write-ahead log."""

from __future__ import annotations

from array import array
from pathlib import Path

import msgpack
import numpy as np
from delayhelpers import T0_MS, config, encoded, ids_of, manual_clock

from qmq.common.clock import ManualClock
from qmq.delay.bucket import Bucket
from qmq.delay.checkpoint import BucketMark, CheckpointJob, DelayCheckpoint, read_delay_checkpoint
from qmq.delay.far import FarMessages
from qmq.delay.recovery import recover
from qmq.delay.schedule import Schedule
from qmq.delay.scheduler import Scheduler
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store.message_log import MessageLog

MINUTE = 60_000


def records_of(messages: list[tuple[str, int]], first_seq: int = 0) -> tuple[bytearray, np.ndarray, np.ndarray]:
    """Write-ahead log records of ``(message id, due_ms)`` messages: their bytes, dues and sizes."""
    bodies = [encoded("s", mid, due) for mid, due in messages]
    out = bytearray(sum(RECORD_HEADER_BYTES + len(b) for b in bodies))
    pos = 0
    for seq, body in enumerate(bodies, first_seq):
        pos = pack_record_into(out, pos, body, seq, T0_MS)
    dues = np.array([due for _, due in messages], dtype=np.int64)
    sizes = np.array([RECORD_HEADER_BYTES + len(b) for b in bodies], dtype=np.int64)
    return out, dues, sizes


def test_far_messages_wait_and_come_back_one_run_per_bucket_in_log_order() -> None:
    clock = manual_clock()
    far = FarMessages(clock, preload_ms=5_000, checkpoint_interval_ms=10_000)
    cutoff = far.cutoff_ms()
    assert cutoff == T0_MS + 75_000
    clock.advance(30)
    assert far.cutoff_ms() == cutoff  # fixed until the flush
    a, b = T0_MS + 30 * MINUTE, T0_MS + 90 * MINUTE
    first = memoryview(b"A1bbB1")  # three records: A1 (bucket a), bb (b), B1 (b)
    far.add(first, 1000, np.array([a + 5, b + 2, b + 1]), np.array([2, 2, 2]), np.array([2, 4, 6]), np.array([a, b, b]))
    far.add(memoryview(b"A2"), 2000, np.array([a + 1]), np.array([2]), np.array([2]), np.array([a]))
    assert far
    runs = list(far.take_runs())
    assert [r.start_ms for r in runs] == [a, b]
    assert [r.records for r in runs] == [b"A1A2", b"bbB1"]
    assert runs[0].dues.tolist() == [a + 5, a + 1]
    assert [r.wal_end for r in runs] == [2002, 1006]
    assert not far
    assert far.from_ms is None
    assert far.cutoff_ms() == T0_MS + 30_000 + 75_000  # a new cut-off from the next batch on


def test_the_checkpoint_holds_the_documented_map_in_its_order(tmp_path: Path) -> None:
    marks = [BucketMark(T0_MS, 300, 3, T0_MS + 10, 900), BucketMark(T0_MS + MINUTE, 0, 0, 0, 0)]
    checkpoint = DelayCheckpoint(T0_MS, 900, 3, MINUTE, marks)
    job = CheckpointJob(tmp_path, [], checkpoint)
    job.run()
    assert job.wal_offset == 900
    expected = {
        "version": 1,
        "time_ms": T0_MS,
        "wal_offset": 900,
        "wal_messages": 3,
        "bucket_ms": MINUTE,
        "buckets": [[T0_MS, 300, 3, T0_MS + 10, 900], [T0_MS + MINUTE, 0, 0, 0, 0]],
    }
    # after the 8-byte head (magic, CRC32C): exactly the msgpack of this map, keys in this order
    assert (tmp_path / "checkpoint").read_bytes()[8:] == msgpack.packb(expected, use_bin_type=True)
    assert read_delay_checkpoint(tmp_path) == checkpoint


def test_a_checkpoint_without_bucket_ms_reads_as_not_saying(tmp_path: Path) -> None:
    state = {"wal_offset": 5, "wal_messages": 1, "buckets": [[T0_MS, 1, 1, T0_MS, 5]]}
    checkpoint = DelayCheckpoint.from_state(state)
    assert checkpoint.bucket_ms is None
    assert checkpoint.buckets == [BucketMark(T0_MS, 1, 1, T0_MS, 5)]


def test_a_bucket_mark_covers_what_was_written_not_what_is_buffered(tmp_path: Path) -> None:
    b = Bucket(tmp_path, T0_MS)
    b.create()
    b.add(b"x" * 40, T0_MS + 7, 100)
    b.flush()
    b.add(b"y" * 10, T0_MS + 3, 150)
    assert BucketMark.of(b) == BucketMark(T0_MS, 40, 1, T0_MS + 3, 150)
    b.close()


def test_a_schedule_alone_takes_records_counts_them_and_knows_what_is_finished(tmp_path: Path) -> None:
    clock = manual_clock()
    schedule = Schedule(config(tmp_path), clock)
    records, dues, sizes = records_of([("a", T0_MS + 1_000), ("b", T0_MS + MINUTE + 1), ("c", T0_MS + 2_000)])
    rows = schedule.replay(records, dues, sizes, T0_MS, 0)
    assert len(rows) == 0  # no bucket is loaded
    assert schedule.starts == [T0_MS, T0_MS + MINUTE]
    assert [schedule.buckets[s].count for s in schedule.starts] == [2, 1]
    assert schedule.pending_total == 3
    assert schedule.created_bucket
    written = schedule.flush_buffers()
    assert written == len(records) + 3 * 20 + 3 * 4  # records, index entries and id-file entries
    assert schedule.buffered_bytes == 0
    paths = schedule.take_written_paths()
    assert schedule.directory in paths  # new bucket directories are fsynced with the checkpoint
    assert schedule.take_written_paths() == []
    assert schedule.dispatched(T0_MS, array("I", [0, 1]).tobytes()) == 2
    assert schedule.pending_total == 1
    assert schedule.dispatched(T0_MS + 5 * MINUTE, array("I", [0]).tobytes()) == 0  # no such bucket
    later = T0_MS + 2 * MINUTE
    assert schedule.finished_buckets(later) == []  # no checkpoint covers bucket T0 yet
    assert schedule.checkpointed(len(records)) == len(records)
    assert schedule.checkpointed(0) == len(records)  # never goes back
    assert [b.start_ms for b in schedule.finished_buckets(later)] == [T0_MS]
    schedule.close()


def test_the_scheduler_runs_on_a_schedule_alone(tmp_path: Path) -> None:
    clock: ManualClock = manual_clock()
    schedule = Schedule(config(tmp_path), clock)
    sched = Scheduler(schedule, 5_000)
    records, dues, sizes = records_of([("late", T0_MS + 2_000), ("early", T0_MS + 1_000)])
    schedule.replay(records, dues, sizes, T0_MS, 0)
    assert sched.load_due(clock.now_ms()) == 2
    clock.advance(2)
    rows = sched.take(clock.now_ms(), 100, 1 << 30)
    handover = sched.read(rows)
    assert ids_of(handover.encoded) == ["early", "late"]
    assert sched.dispatched(T0_MS, array("I", rows["entry"].tolist()).tobytes()) == 2
    assert schedule.pending_total == 0
    schedule.close()


def test_recovery_builds_the_parts_from_a_write_ahead_log_alone(tmp_path: Path) -> None:
    clock = manual_clock()
    wal = MessageLog(tmp_path / "wal", 1 << 20)
    records, _dues, _sizes = records_of([("a", T0_MS + 1_000), ("b", T0_MS + MINUTE + 5)])
    wal.append(records)
    parts, report = recover(config(tmp_path), clock, wal)
    assert report["from_checkpoint"] is False
    assert report["records_replayed"] == 2
    assert parts.wal_messages == 2
    schedule = parts.schedule
    assert schedule.starts == [T0_MS, T0_MS + MINUTE]
    assert schedule.pending_total == 2
    assert schedule.buckets[T0_MS + MINUTE].wal_end == len(records)
    schedule.close()
    wal.close()
