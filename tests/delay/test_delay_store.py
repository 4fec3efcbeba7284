"""The delay store: buckets by due time, refusals by index, the files' bytes, checkpoints,
deletion of replayed write-ahead log segments, and recovery after a crash."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from crc32c import crc32c
from delayhelpers import T0_MS, append, encoded, manual_clock, open_store

from qmq.delay.bucket import DISPATCH, INDEX, INDEX_ENTRY, MESSAGES
from qmq.delay.dispatch_log import DISPATCH_KIND
from qmq.delay.store import DAY_MS, HORIZON_SLACK_MS
from qmq.protocol.codes import Status
from qmq.protocol.record import RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store.datadir import StoreError
from qmq.store.file_header import header

MINUTE = 60_000


def test_a_message_goes_to_the_bucket_of_its_due_time(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    result = append(store, [("s", "a", T0_MS + 30_000), ("s", "b", T0_MS + 90_000), ("s", "c", T0_MS + 10 * MINUTE)])
    assert result.errors == []
    assert result.stored == 3
    store.flush_deferred()  # the 10-minute bucket's message waited to be sorted in with others
    assert store.starts == [T0_MS, T0_MS + MINUTE, T0_MS + 10 * MINUTE]
    assert [store.buckets[s].count for s in store.starts] == [1, 1, 1]
    assert store.pending_total == 3
    store.close()


def test_a_message_already_due_joins_the_current_bucket_never_a_past_one(tmp_path: Path) -> None:
    clock = manual_clock()
    clock.advance(5 * 60)  # T0 + 5 min
    store = open_store(tmp_path, clock)
    append(store, [("s", "old", T0_MS - DAY_MS), ("s", "now", 0)])
    assert store.starts == [T0_MS + 5 * MINUTE]
    b = store.buckets[T0_MS + 5 * MINUTE]
    assert b.count == 2
    # the due times are kept as sent: both are due at once
    assert b.load_index(2)["due"].tolist() == [T0_MS - DAY_MS, 0]
    store.close()


def test_refusals_name_the_message_by_index_and_say_what_to_do(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, horizon_days=730)
    beyond = T0_MS + 731 * DAY_MS
    frame = encoded("ok", "a", T0_MS + 1000) + encoded("bad subject", "b", T0_MS) + encoded("ok", "c", beyond)
    from qmq.protocol.message import scan_batch

    result = store.append(frame, scan_batch(frame))
    assert result.stored == 1
    by_index = {e[0]: e for e in result.errors}
    assert by_index[1][1] == Status.INVALID_SUBJECT
    assert by_index[2][1] == Status.INVALID_MESSAGE
    text = by_index[2][2]
    assert "is 731.0 days ahead" in text
    assert "the horizon is 730 days (horizon_days)" in text
    assert "2025-11-14" in text  # the due time, readable
    store.close()


def test_a_delay_of_exactly_the_horizon_is_taken_though_the_senders_clock_ran_ahead(tmp_path: Path) -> None:
    # the gateway's document allows delay_ms up to the horizon; the SDK rounds deliver_at up to
    # the next millisecond and this server's clock may be behind the sender's: taken, with slack
    clock = manual_clock()
    store = open_store(tmp_path, clock, horizon_days=730)
    edge = T0_MS + 730 * DAY_MS + 1
    past = T0_MS + 730 * DAY_MS + HORIZON_SLACK_MS + 1
    frame = encoded("ok", "edge", edge) + encoded("ok", "past", past)
    from qmq.protocol.message import scan_batch

    result = store.append(frame, scan_batch(frame))
    assert result.stored == 1
    assert [e[0] for e in result.errors] == [1]
    store.close()


def test_files_hold_records_index_entries_and_dispatch_entries_byte_by_byte(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", "a", T0_MS + 2000), ("s", "b", T0_MS + 1000)], body=b"hello")
    store.flush_buffers()
    b = store.buckets[T0_MS]
    messages = (b.directory / MESSAGES).read_bytes()
    index = (b.directory / INDEX).read_bytes()
    assert len(index) == 2 * 20
    due0, off0, size0 = INDEX_ENTRY.unpack_from(index, 0)
    due1, off1, size1 = INDEX_ENTRY.unpack_from(index, 20)
    assert (due0, off0) == (T0_MS + 2000, 0)
    assert (due1, off1) == (T0_MS + 1000, size0)
    assert off1 + size1 == len(messages)
    magic, _crc, length, seq, stored_ms = RECORD_HEADER.unpack_from(messages, off1)
    assert length == size1 - RECORD_HEADER_BYTES
    assert magic == RECORD_MAGIC
    assert seq == 1  # the write-ahead log's message count
    assert stored_ms == T0_MS
    assert messages[off1 + RECORD_HEADER_BYTES : off1 + size1] == encoded("s", "b", T0_MS + 1000, b"hello")
    b.append_dispatch(struct.pack("<I", 1))
    entry = b"\x01\x00\x00\x00"  # entry 1, then its CRC32C (dispatch_log.py), after the file header
    assert (b.directory / DISPATCH).read_bytes() == header(DISPATCH_KIND) + entry + struct.pack("<I", crc32c(entry))
    assert b.dispatched == 1
    store.close()


def test_checkpoint_deletes_replayed_wal_segments(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock, wal_segment_bytes=64 * 1024)
    for i in range(40):
        append(store, [("s", f"m{i}-{k}", T0_MS + 3 * MINUTE) for k in range(10)], body=b"x" * 300)
    segments_before = len(store.wal.segments.segments)
    assert segments_before > 2
    job = store.checkpoint_job()
    job.run()
    deleted = store.after_checkpoint(job)
    assert deleted == segments_before - 1  # all but the active one
    assert len(list((tmp_path / "wal").glob("*.log"))) == 1
    store.close()


def test_a_rewind_it_must_refuse_cuts_nothing(tmp_path: Path) -> None:
    """A demoted master whose checkpoint covers records past the cut and whose log no longer
    begins at 0 cannot rebuild its schedule: refused with its log whole, so the follow order,
    coming again, is refused again rather than copying on top of a schedule holding cut records."""
    clock = manual_clock()
    store = open_store(tmp_path, clock, wal_segment_bytes=64 * 1024)
    for i in range(40):
        append(store, [("s", f"m{i}-{k}", T0_MS + 3 * MINUTE) for k in range(10)], body=b"x" * 300)
    cut_at = store.wal.end
    append(store, [("s", f"late-{k}", T0_MS + 3 * MINUTE) for k in range(10)], body=b"x" * 300)
    assert store.wal.segments.active.base <= cut_at  # the cut is in the segment the checkpoint keeps
    job = store.checkpoint_job()
    job.run()
    assert store.after_checkpoint(job) > 0
    assert store.wal.start > 0
    end, pending = store.wal.end, store.pending_total
    with pytest.raises(StoreError, match="its log no longer begins at 0"):
        store.rewind(cut_at)
    assert (store.wal.end, store.pending_total) == (end, pending)
    with pytest.raises(StoreError, match="its log no longer begins at 0"):
        store.rewind(cut_at)  # the next follow order
    store.close()


def test_recovery_replays_the_wal_after_the_checkpoint_with_the_same_entry_numbers(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", "a", T0_MS + 1000), ("s", "b", T0_MS + 2000)])
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)
    append(store, [("s", "c", T0_MS + 3000), ("s", "d", T0_MS + 4000)])
    store.flush_buffers()
    b = store.buckets[T0_MS]
    b.append_dispatch(struct.pack("<II", 0, 3))  # a and d were handed over
    store.close()  # a crash: no checkpoint after c and d

    store = open_store(tmp_path, clock)
    b = store.buckets[T0_MS]
    assert b.count == 4
    assert b.dispatched == 2
    assert store.pending_total == 2
    index = b.load_index(4)
    assert index["due"].tolist() == [T0_MS + 1000, T0_MS + 2000, T0_MS + 3000, T0_MS + 4000]
    store.close()


def test_recovery_cuts_schedule_logs_written_after_the_checkpoint_and_rebuilds_them(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", "a", T0_MS + 1000)])
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)
    append(store, [("s", "b", T0_MS + 2000)])
    store.flush_buffers()
    bucket_dir = store.buckets[T0_MS].directory
    store.close()
    # garbage after what the log holds: recovery must cut it, not trust it
    with open(bucket_dir / INDEX, "ab") as fh:
        fh.write(INDEX_ENTRY.pack(T0_MS, 999_999, 50))
    store = open_store(tmp_path, clock)
    b = store.buckets[T0_MS]
    assert b.count == 2
    assert (bucket_dir / INDEX).stat().st_size == 40
    store.close()


@pytest.mark.parametrize("damaged", [INDEX, MESSAGES])
def test_a_schedule_log_cut_below_its_checkpoint_is_rebuilt_from_the_write_ahead_log(
    tmp_path: Path, damaged: str
) -> None:
    # Found by the fault campaign (chaos/, corruption): a cut index was trusted to hold what the
    # checkpoint counted, so the messages past the cut were never handed over.
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", f"m{i}", T0_MS + 1000 * (i + 1)) for i in range(6)])
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)
    b = store.buckets[T0_MS]
    b.append_dispatch(struct.pack("<I", 0))  # m0 was handed over
    bucket_dir = b.directory
    store.close()
    with open(bucket_dir / damaged, "r+b") as fh:
        fh.truncate((bucket_dir / damaged).stat().st_size // 3)
    store = open_store(tmp_path, clock)
    b = store.buckets[T0_MS]
    assert b.count == 6
    assert b.dispatched == 1
    assert store.pending_total == 5
    assert b.load_index(6)["due"].tolist() == [T0_MS + 1000 * (i + 1) for i in range(6)]
    store.close()


def test_a_schedule_index_with_bytes_flipped_is_rebuilt_from_its_records(tmp_path: Path) -> None:
    # Found by the fault campaign (chaos/, corruption): index entries were trusted, so an entry
    # whose offset or size was flipped named no record (the message was skipped as corrupt at
    # hand-over: lost) and one whose due time was flipped was handed over years late.
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", f"m{i}", T0_MS + 1000 * (i + 1)) for i in range(6)])
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)
    bucket_dir = store.buckets[T0_MS].directory
    store.close()
    index = bucket_dir / INDEX
    before = index.read_bytes()
    data = bytearray(before)
    data[3 * INDEX_ENTRY.size + 8] ^= 0x04  # entry 3's offset
    data[4 * INDEX_ENTRY.size + 5] ^= 0x20  # entry 4's due time, about 4 years later
    index.write_bytes(bytes(data))
    store = open_store(tmp_path, clock)
    assert index.read_bytes() == before
    assert store.buckets[T0_MS].load_index(6)["due"].tolist() == [T0_MS + 1000 * (i + 1) for i in range(6)]
    store.close()


def test_a_rebuilt_schedule_index_keeps_entry_numbers_past_a_damaged_record(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", f"m{i}", T0_MS + 1000 * (i + 1)) for i in range(6)])
    job = store.checkpoint_job()
    job.run()
    store.after_checkpoint(job)
    bucket_dir = store.buckets[T0_MS].directory
    store.close()
    index = bucket_dir / INDEX
    before = index.read_bytes()
    offsets = [INDEX_ENTRY.unpack_from(before, n * INDEX_ENTRY.size)[1] for n in range(6)]
    messages = bytearray((bucket_dir / MESSAGES).read_bytes())
    messages[offsets[2] + 8] ^= 0x01  # record 2's length: its framing is gone
    (bucket_dir / MESSAGES).write_bytes(bytes(messages))
    data = bytearray(before)
    data[4 * INDEX_ENTRY.size + 8] ^= 0x02  # and entry 4's offset
    index.write_bytes(bytes(data))
    store = open_store(tmp_path, clock)
    assert index.read_bytes() == before  # entry 2 kept as it was (its record fails at hand-over)
    store.close()


def test_a_torn_wal_tail_is_cut_and_its_dispatch_entries_dropped(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    append(store, [("s", "a", T0_MS + 1000)])
    append(store, [("s", "b", T0_MS + 2000)])
    store.flush_buffers()
    store.buckets[T0_MS].append_dispatch(struct.pack("<I", 1))
    wal_file = sorted((tmp_path / "wal").glob("*.log"))[-1]
    store.close()
    size = wal_file.stat().st_size
    os.truncate(wal_file, size - 5)  # the second record is torn
    store = open_store(tmp_path, clock)
    b = store.buckets[T0_MS]
    assert b.count == 1
    assert b.dispatched == 0  # entry 1 no longer exists
    store.close()


def test_a_second_store_on_the_same_directory_is_refused(tmp_path: Path) -> None:
    from qmq.store.datadir import StoreError

    clock = manual_clock()
    store = open_store(tmp_path, clock)
    with pytest.raises(StoreError, match="in use by another delay server"):
        open_store(tmp_path, clock)
    store.close()


def test_a_batch_spread_over_many_buckets_keeps_log_order_in_each(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    # 100 messages over 50 one-minute buckets, two in each, plus 40 in one bucket (the numpy path)
    messages = [("s", f"m{i}", T0_MS + (i % 50) * MINUTE + i) for i in range(100)]
    messages += [("s", f"n{i}", T0_MS + 7 * MINUTE + 500 + i) for i in range(40)]
    append(store, messages)
    store.flush_deferred()
    assert len(store.starts) == 50
    assert store.pending_total == 140
    b7 = store.buckets[T0_MS + 7 * MINUTE]
    assert b7.count == 42
    assert b7.load_index(42)["due"].tolist() == [T0_MS + 7 * MINUTE + 7, T0_MS + 7 * MINUTE + 57] + [
        T0_MS + 7 * MINUTE + 500 + i for i in range(40)
    ]
    store.close()
    # replayed from the write-ahead log (no checkpoint): the same buckets, entries in the same order
    for d in (tmp_path / "schedule").iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    store = open_store(tmp_path, clock)
    assert len(store.starts) == 50
    assert store.buckets[T0_MS + 7 * MINUTE].load_index(42)["due"].tolist()[:2] == [
        T0_MS + 7 * MINUTE + 7,
        T0_MS + 7 * MINUTE + 57,
    ]
    store.close()


def test_messages_of_far_buckets_wait_and_are_sorted_in_by_the_flush_in_log_order(tmp_path: Path) -> None:
    """A backlog spread over weeks gives each bucket a message or two per batch: those of
    buckets that cannot be loaded before the next flush wait, and the flush adds them per
    bucket in one run, in the order of the write-ahead log; near buckets take theirs at once."""
    clock = manual_clock()
    store = open_store(tmp_path, clock)  # preload 5 s, checkpoints every 10 s: far is > 75 s ahead
    far_a, far_b = T0_MS + 30 * MINUTE, T0_MS + 90 * MINUTE
    append(store, [("s", "near-1", T0_MS + 1_000), ("s", "a1", far_a + 5), ("s", "b1", far_b + 1)])
    clock.advance(3)
    append(store, [("s", "a2", far_a + 1), ("s", "near-2", T0_MS + 2_000), ("s", "b2", far_b + 9)])
    assert store.starts == [T0_MS]  # only the near bucket so far
    assert store.buckets[T0_MS].count == 2
    assert store.pending_total == 6
    wal_end = store.wal.end
    store.flush_buffers()
    assert store.starts == [T0_MS, far_a, far_b]
    a, b = store.buckets[far_a], store.buckets[far_b]
    assert a.load_index(2)["due"].tolist() == [far_a + 5, far_a + 1]  # log order, not due order
    assert b.load_index(2)["due"].tolist() == [far_b + 1, far_b + 9]
    assert b.wal_end == wal_end  # b2 ends the log
    assert a.wal_end < wal_end  # a2 is followed by near-2 and b2
    store.close()
    # recovery from the write-ahead log alone gives the same entries
    for d in (tmp_path / "schedule").iterdir():
        for f in d.iterdir():
            f.unlink()
        d.rmdir()
    (tmp_path / "checkpoint").unlink(missing_ok=True)
    store = open_store(tmp_path, clock)
    assert store.buckets[far_a].load_index(2)["due"].tolist() == [far_a + 5, far_a + 1]
    assert store.pending_total == 6
    store.close()


def test_a_far_bucket_is_never_loaded_before_its_waiting_messages_are_in_it(tmp_path: Path) -> None:
    from qmq.delay.scheduler import Scheduler

    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, 5_000)
    far = T0_MS + 2 * MINUTE
    append(store, [("s", "x", far + 10), ("s", "y", T0_MS + 500)])
    assert far not in store.buckets  # waiting
    # no checkpoint flushed it (stalled): when the bucket is about to be loaded, it is written first
    clock.advance(2 * 60 - 4)
    loaded = [b.start_ms for b in sched.to_load(clock.now_ms())]
    assert far in loaded
    sched.load(store.buckets[far])
    assert len(sched.timer) >= 1
    store.close()
