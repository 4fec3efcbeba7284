"""Recovery of the delay server's store after any stop, clean or not.

1. Read the checkpoint: the write-ahead log offset its schedule logs cover, and each bucket's
   sizes at that moment.
2. Cut every bucket back to its checkpointed sizes (a bucket the checkpoint does not name was
   begun after it: cut to nothing). What was cut is exactly what the write-ahead log holds
   after the checkpoint's offset.
3. Replay the write-ahead log from that offset into the buckets, in order, checking every
   CRC; the first record that does not check out is a torn tail, cut and logged. Replaying in
   the original order gives every message the entry number it had, so the dispatch logs stay
   right.
   A cancel record (cancel.py) is applied where it stands: the messages replayed before it
   are in their buckets then, the ones after it not yet.
   A bucket whose files hold less than its mark (damaged) makes recovery rebuild every bucket
   from the write-ahead log's start, or, when that is gone, refuse to start naming it. A
   bucket whose index entries cannot be right (bytes flipped: an entry that does not begin
   where the one before it ends, or is due after the bucket ends) has its index rebuilt from
   its own records (bucket.rebuild_index).
4. Drop dispatch-log entries that fail their CRC (dispatch_log.py: their messages are handed
   over again) or name messages that are no longer there (a torn tail's), write a dispatch log
   of the old format (no CRC) anew in the current one, and delete buckets left empty.

Without a checkpoint the write-ahead log is replayed from its start. If its first segments
are gone (the checkpoint was damaged), the schedule logs are kept as they are and the log is
replayed over them: messages may then be handed over twice, which the broker's duplicate
window drops; this is logged.

The store hands recovery its open write-ahead log and takes the parts it returns
(``DelayParts``); recovery knows nothing of the store itself.
"""

from __future__ import annotations

import logging
import struct
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from qmq.common.clock import Clock
from qmq.common.config import DelayConfig
from qmq.delay import cancel
from qmq.delay.bucket import INDEX, INDEX_ENTRY_BYTES, MESSAGES, Bucket, index_faults, rebuild_index
from qmq.delay.checkpoint import BucketMark, read_delay_checkpoint
from qmq.delay.schedule import Schedule
from qmq.protocol.message import HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store import fileio
from qmq.store.datadir import StoreError
from qmq.store.message_log import MessageLog, ScanResult

log = logging.getLogger(__name__)

_CHUNK_BYTES = 4 * 1024 * 1024
# deliver_at_ms in an encoded message: an i64 at byte 16 (qmq.protocol.message)
_DELIVER_AT = struct.Struct("<q")
_DELIVER_AT_POS = 16


@dataclass(slots=True)
class DelayParts:
    """The in-memory state of a delay store beside its write-ahead log."""

    schedule: Schedule  # the time buckets, what is buffered for them and what checkpoints cover
    wal_messages: int  # records in the write-ahead log: the next record's sequence


def empty_parts(config: DelayConfig, clock: Clock) -> DelayParts:
    """Parts that know nothing yet (what a store holds until it is opened)."""
    return DelayParts(Schedule(config, clock), 0)


def recover(config: DelayConfig, clock: Clock, wal: MessageLog) -> tuple[DelayParts, dict[str, Any]]:
    """The parts of the store in ``config.data_dir``, whose write-ahead log is open (its torn
    tail is cut), and a report of what recovery found."""
    t0 = time.monotonic()
    checkpoint = read_delay_checkpoint(Path(config.data_dir))
    parts = empty_parts(config, clock)
    schedule = parts.schedule
    marks: dict[int, BucketMark] = {}
    if checkpoint is not None:
        replay_from = checkpoint.wal_offset
        parts.wal_messages = checkpoint.wal_messages
        schedule.checkpointed_offset = replay_from
        marks = {m.start_ms: m for m in checkpoint.buckets}
        if checkpoint.bucket_ms is not None and checkpoint.bucket_ms != schedule.bucket_ms:
            log.warning(
                "the time bucket length changed from %d ms to %d ms; existing buckets keep theirs",
                checkpoint.bucket_ms,
                schedule.bucket_ms,
            )
    else:
        replay_from = wal.start
    short = [b for b in (schedule.bucket(s) for s in schedule.existing_bucket_starts()) if _short(b, marks)]
    if short:
        # Damaged (cut) schedule-log files: they are rebuilt from the write-ahead log if it still
        # holds everything; otherwise what the damage took is gone, which the operator must accept.
        names = ", ".join(str(b.directory) for b in short[:3])
        if wal.start > 0:
            raise StoreError(
                f"schedule log(s) {names} hold less than the checkpoint says (damaged) and the write-ahead log "
                f"no longer begins at 0 (it begins at {wal.start}), so they cannot be rebuilt: move the damaged "
                "bucket directories out of schedule/ to start without the messages they held"
            )
        log.error(
            "schedule log(s) %s hold less than the checkpoint says: rebuilding every bucket from the write-ahead log",
            names,
        )
        marks, replay_from = {}, wal.start
        schedule.checkpointed_offset = replay_from
    trust_files = checkpoint is None and wal.start > 0
    if trust_files:
        log.error(
            "no usable checkpoint, and the write-ahead log before offset %d is gone: keeping the schedule "
            "logs as they are and replaying the log over them; messages may be handed over twice "
            "(the broker's duplicate window drops repeats)",
            wal.start,
        )

    # an index entry must be due before its bucket ends: the longest bucket length in use
    bucket_ms = max(schedule.bucket_ms, checkpoint.bucket_ms or 0) if checkpoint is not None else schedule.bucket_ms
    rebuilt: list[Bucket] = []
    for start in schedule.existing_bucket_starts():
        b = schedule.bucket(start)
        if trust_files:
            _adopt_files(b)
        elif start in marks:
            mark = marks[start]
            b.truncate(mark.nbytes, mark.entries)
            b.min_due_ms = mark.min_due_ms
            b.wal_end = mark.wal_end
        else:
            b.truncate(0, 0)
        _check_index(b, start + bucket_ms)
        filled = b.fill_ids()
        if filled:
            log.info("bucket %d: rebuilt %d entries of its id file from its records", start, filled)
        rebuilt.append(b)

    result: list[ScanResult] = []
    replayed, cancels, next_sequence = replay_wal(schedule, wal, replay_from, result)
    parts.wal_messages = max(parts.wal_messages, next_sequence)
    schedule.flush_buffers()
    good_end, torn = result[-1] if result else (wal.end, 0)
    if torn:
        wal.truncate(good_end)
        log.warning("write-ahead log: cut a torn tail of %d bytes at offset %d", torn, good_end)

    removed = 0
    damaged = 0
    for b in list(schedule.iter_buckets()):
        found = b.read_dispatch_log()  # entries that fail their CRC are dropped (and logged) there
        damaged += found.damaged
        dispatched = found.entries
        valid = np.unique(dispatched[dispatched < b.count])
        if len(valid) != len(dispatched):
            log.warning(
                "bucket %d: dropping %d dispatch-log entries of messages no longer in it (or repeated)",
                b.start_ms,
                len(dispatched) - len(valid),
            )
        if len(valid) != len(dispatched) or not found.clean:
            b.rewrite_dispatch(valid)  # also cuts a torn tail, and writes an old format's log anew
        b.dispatched = len(valid)
        if b.count == 0:
            schedule.remove_bucket(b)
            removed += 1
    schedule.pending_total = sum(b.pending for b in schedule.buckets.values())
    return parts, {
        "from_checkpoint": checkpoint is not None,
        "replayed_from": replay_from,
        "records_replayed": replayed,
        "entries_cancelled": cancels,
        "torn_bytes": torn,
        "dispatch_entries_damaged": damaged,
        "buckets": len(schedule.buckets),
        "buckets_rebuilt": len(rebuilt),
        "empty_buckets_removed": removed,
        "pending": schedule.pending_total,
        "seconds": round(time.monotonic() - t0, 3),
    }


def replay_wal(schedule: Schedule, wal: MessageLog, start: int, result: list[ScanResult]) -> tuple[int, int, int]:
    """Replay the write-ahead log's records from ``start`` into their buckets, in order, applying
    cancel records where they stand: recovery's step 3, and a delay slave's for what it copied.
    Returns (records replayed, entries cancelled, the sequence after the last record); a torn
    tail is added to ``result`` as ``wal.scan`` does."""
    replayed = 0
    cancels = 0
    next_sequence = 0
    chunk = _Chunk()
    for rec in wal.scan(start, result):
        msg = rec.message
        if len(msg) < HEADER_BYTES:
            result.append(ScanResult(rec.offset, wal.end - rec.offset))
            break
        next_sequence = rec.sequence + 1
        replayed += 1
        if cancel.is_cancel(msg):
            chunk.replay_into(schedule)
            schedule.flush_deferred()
            stops = cancel.pending_entries(list(schedule.iter_buckets()), cancel.cancelled_id(msg), None)
            cancels += cancel.apply(stops, None, schedule.note_cancelled)
            continue
        chunk.add(rec.offset, msg, rec.sequence, rec.stored_ms)
        if len(chunk.records) >= _CHUNK_BYTES:
            chunk.replay_into(schedule)
    chunk.replay_into(schedule)
    return replayed, cancels, next_sequence


class _Chunk:
    """Write-ahead log records gathered to be replayed together (they are contiguous in the log)."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self.base = -1
        self.records = bytearray()
        self.dues: list[int] = []
        self.sizes: list[int] = []
        self.stored: list[int] = []

    def add(self, offset: int, message: memoryview, sequence: int, stored_ms: int) -> None:
        if self.base < 0:
            self.base = offset
        (due_ms,) = _DELIVER_AT.unpack_from(message, _DELIVER_AT_POS)
        # the schedule log takes the whole record, header included, as the write-ahead log has it
        at = len(self.records)
        self.records += bytes(RECORD_HEADER_BYTES + len(message))
        pack_record_into(self.records, at, message, sequence, stored_ms)
        self.dues.append(due_ms)
        self.sizes.append(RECORD_HEADER_BYTES + len(message))
        self.stored.append(stored_ms)

    def replay_into(self, schedule: Schedule) -> None:
        if self.dues:
            schedule.replay(
                self.records,
                np.array(self.dues, dtype=np.int64),
                np.array(self.sizes, dtype=np.int64),
                np.array(self.stored, dtype=np.int64),
                self.base,
            )
            schedule.after_replay()
        self.reset()


def _short(b: Bucket, marks: dict[int, BucketMark]) -> bool:
    """Whether a bucket's files hold less than its checkpoint mark says (damaged, cut)."""
    mark = marks.get(b.start_ms)
    if mark is None:
        return False
    sizes = [p.stat().st_size if p.exists() else 0 for p in b.file_paths()[:2]]
    return sizes[0] < mark.nbytes or sizes[1] < mark.entries * INDEX_ENTRY_BYTES


def _check_index(b: Bucket, due_end_ms: int) -> None:
    """Rebuild a bucket's index from its records when its entries cannot be right (damaged:
    bucket.index_faults); logged, naming the file."""
    index = b.load_index(b.flushed_count)
    faults = index_faults(index, b.flushed_bytes, due_end_ms)
    if not faults:
        return
    fixed, damaged = rebuild_index(b.directory, index, b.flushed_bytes)
    b.close()
    fileio.replace_file(b.directory / INDEX, fixed.tobytes())
    log.error(
        "schedule index %s: %d of its %d entries do not fit its records (damaged): rebuilt from %s%s",
        b.directory / INDEX,
        faults,
        len(index),
        b.directory / MESSAGES,
        f"; {len(damaged)} records there fail their check and are lost (entries {damaged[:5]})" if damaged else "",
    )
    b.min_due_ms = int(fixed["due"].min()) if len(fixed) else 0


def _adopt_files(b: Bucket) -> None:
    """Take a bucket's files as they are (no checkpoint to cut them to): whole index entries only."""
    paths = b.file_paths()
    messages_size = paths[0].stat().st_size if paths[0].exists() else 0
    index_size = paths[1].stat().st_size if paths[1].exists() else 0
    entries = index_size // INDEX_ENTRY_BYTES
    b.truncate(messages_size, entries)
    index = b.load_index(entries)
    if len(index):
        inside = index["offset"] + index["size"] <= messages_size
        if not inside.all():
            entries = int(np.argmin(inside))
            b.truncate(messages_size, entries)
            index = index[:entries]
    b.min_due_ms = int(index["due"].min()) if len(index) else 0
