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
4. Drop dispatch-log entries naming messages that are no longer there (a torn tail's), and
   delete buckets left empty.

Without a checkpoint the write-ahead log is replayed from its start. If its first segments
are gone (the checkpoint was damaged), the schedule logs are kept as they are and the log is
replayed over them: messages may then be handed over twice, which the broker's duplicate
window drops; this is logged.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any

import numpy as np

from qmq.delay.bucket import INDEX_ENTRY_BYTES, Bucket
from qmq.delay.store import DELIVER_AT, DELIVER_AT_POS
from qmq.protocol.message import HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store.checkpoint import read_checkpoint
from qmq.store.message_log import ScanResult

if TYPE_CHECKING:
    from qmq.delay.store import DelayStore

log = logging.getLogger(__name__)

_CHUNK_BYTES = 4 * 1024 * 1024


def recover(store: DelayStore) -> dict[str, Any]:
    t0 = time.monotonic()
    state = read_checkpoint(store.dir)
    wal = store.wal
    summaries: dict[int, list[int]] = {}
    if state is not None:
        replay_from = int(state["wal_offset"])
        store.wal_messages = int(state["wal_messages"])
        store.checkpointed_offset = replay_from
        summaries = {int(s[0]): [int(x) for x in s] for s in state["buckets"]}
        if int(state.get("bucket_ms", store.bucket_ms)) != store.bucket_ms:
            log.warning(
                "the time bucket length changed from %d ms to %d ms; existing buckets keep theirs",
                state["bucket_ms"],
                store.bucket_ms,
            )
    else:
        replay_from = wal.start
    trust_files = state is None and wal.start > 0
    if trust_files:
        log.error(
            "no usable checkpoint, and the write-ahead log before offset %d is gone: keeping the schedule "
            "logs as they are and replaying the log over them; messages may be handed over twice "
            "(the broker's duplicate window drops repeats)",
            wal.start,
        )

    rebuilt: list[Bucket] = []
    for start in store.existing_bucket_starts():
        b = store.bucket(start)
        if trust_files:
            _adopt_files(b)
        elif start in summaries:
            _, nbytes, entries, min_due, wal_end = summaries[start]
            b.truncate(nbytes, entries)
            b.min_due_ms = min_due
            b.wal_end = wal_end
        else:
            b.truncate(0, 0)
        rebuilt.append(b)

    replayed = 0
    result: list[ScanResult] = []
    chunk = _Chunk()
    for rec in wal.scan(replay_from, result):
        msg = rec.message
        if len(msg) < HEADER_BYTES:
            result.append(ScanResult(rec.offset, wal.end - rec.offset))
            break
        chunk.add(rec.offset, msg, rec.sequence, rec.stored_ms)
        store.wal_messages = max(store.wal_messages, rec.sequence + 1)
        replayed += 1
        if len(chunk.records) >= _CHUNK_BYTES:
            chunk.replay_into(store)
    chunk.replay_into(store)
    store.flush_buffers()
    good_end, torn = result[-1] if result else (wal.end, 0)
    if torn:
        wal.truncate(good_end)
        log.warning("write-ahead log: cut a torn tail of %d bytes at offset %d", torn, good_end)

    removed = 0
    for b in list(store.iter_buckets()):
        dispatched = b.read_dispatched()
        valid = np.unique(dispatched[dispatched < b.count])
        if len(valid) != len(dispatched):
            log.warning(
                "bucket %d: dropping %d dispatch-log entries of messages no longer in it (or repeated)",
                b.start_ms,
                len(dispatched) - len(valid),
            )
            b.rewrite_dispatch(valid)
        b.dispatched = len(valid)
        if b.count == 0:
            store.remove_bucket(b)
            removed += 1
    store.pending_total = sum(b.pending for b in store.buckets.values())
    return {
        "from_checkpoint": state is not None,
        "replayed_from": replay_from,
        "records_replayed": replayed,
        "torn_bytes": torn,
        "buckets": len(store.buckets),
        "buckets_rebuilt": len(rebuilt),
        "empty_buckets_removed": removed,
        "pending": store.pending_total,
        "seconds": round(time.monotonic() - t0, 3),
    }


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
        (due_ms,) = DELIVER_AT.unpack_from(message, DELIVER_AT_POS)
        # the schedule log takes the whole record, header included, as the write-ahead log has it
        at = len(self.records)
        self.records += bytes(RECORD_HEADER_BYTES + len(message))
        pack_record_into(self.records, at, message, sequence, stored_ms)
        self.dues.append(due_ms)
        self.sizes.append(RECORD_HEADER_BYTES + len(message))
        self.stored.append(stored_ms)

    def replay_into(self, store: DelayStore) -> None:
        if self.dues:
            store.replay(
                self.records,
                np.array(self.dues, dtype=np.int64),
                np.array(self.sizes, dtype=np.int64),
                np.array(self.stored, dtype=np.int64),
                self.base,
            )
            store.after_replay()
        self.reset()


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
