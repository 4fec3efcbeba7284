"""Messages stored ahead of their due time, released into their subjects once due.

A send may carry messages due a moment from now (a delay server hands them over shortly before
they are due; a producer sends those due within ``qmq.common.limits.HOLD_UNTIL_DUE_MS``). The
broker writes each as a *held record*: an ordinary message-log record whose sequence is
``HELD_SEQUENCE``, fsynced and replicated with its send like any other, but in no consume log,
so no pull can reach it. Once due, the master appends a copy of it to its subject — that copy
is what consumers receive. Since the held record is already on disk, the copy needs no fsync
before it is visible: recovery (or a slave) finds held records without a copy after them and
releases them again, so a crash, even a power loss, loses none (a power loss may deliver one
twice).

This module keeps the held records not yet released (a heap by due time for the master's
release timer, and by duplicate key for recovery and slaves, which see copies as records),
releases the due ones, and restores the ones a checkpoint names.
"""

from __future__ import annotations

import heapq
import logging
from typing import TYPE_CHECKING, NamedTuple, Protocol

from qmq.common.errors import QmqError
from qmq.protocol.message import scan_batch
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header, record_crc_ok
from qmq.store.datadir import StoreError
from qmq.store.dedup import dedup_key
from qmq.store.intake import Appending

if TYPE_CHECKING:
    from qmq.common.limits import Limits
    from qmq.store.intake import AppendResult
    from qmq.store.message_log import MessageLog

log = logging.getLogger(__name__)

HELD_SEQUENCE = (1 << 64) - 1
# Copies of held records appended with one write (more wait for the next release).
RELEASE_BATCH_MAX = 2_000
# Adjacent held records (one send's) are read with one pread of at most this many bytes.
_READ_BYTES_MAX = 1024 * 1024


class Held(NamedTuple):
    due_ms: int
    offset: int
    size: int  # the whole record, header included
    key: int  # the duplicate key of its message


class HeldMessages:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (due_ms, offset); entries released meanwhile stay until popped
        self._live: dict[int, Held] = {}  # by offset
        self._by_key: dict[int, list[int]] = {}  # offsets, oldest first (one, unless dedup is off)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, held: Held) -> None:
        self._live[held.offset] = held
        self._by_key.setdefault(held.key, []).append(held.offset)
        heapq.heappush(self._heap, (held.due_ms, held.offset))
        self.bytes += held.size

    def copied(self, key: int) -> None:
        """A copy with this key was stored: the oldest held record with it is released."""
        offsets = self._by_key.get(key)
        if offsets:
            self._forget(self._live[offsets[0]])

    def _forget(self, held: Held) -> None:
        del self._live[held.offset]
        offsets = self._by_key[held.key]
        offsets.remove(held.offset)
        if not offsets:
            del self._by_key[held.key]
        self.bytes -= held.size

    def next_due_ms(self) -> int | None:
        heap, live = self._heap, self._live
        while heap and heap[0][1] not in live:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_due(self, now_ms: int, max_n: int) -> list[Held]:
        """Up to ``max_n`` held records due by ``now_ms``, in due order; they are forgotten."""
        heap, live = self._heap, self._live
        out: list[Held] = []
        while heap and len(out) < max_n and heap[0][0] <= now_ms:
            _due, offset = heapq.heappop(heap)
            held = live.get(offset)
            if held is not None:
                self._forget(held)
                out.append(held)
        return out

    def snapshot(self) -> list[list[int]]:
        """For the checkpoint: [due_ms, offset, size] of each, in offset order (keys are hashes
        of this process: recovery computes them again from the records)."""
        return [[h.due_ms, h.offset, h.size] for h in sorted(self._live.values(), key=lambda h: h.offset)]

    def restore(self, mlog: MessageLog, rows: list[list[int]]) -> None:
        """Hold again what a checkpoint names ([due_ms, offset, size], see ``snapshot``)."""
        for (due_ms, offset, size), record in zip(rows, read_spans(mlog, [(r[1], r[2]) for r in rows]), strict=True):
            header = None if record is None else read_record_header(record, 0)
            if (
                record is None
                or header is None
                or header.sequence != HELD_SEQUENCE
                or not record_crc_ok(record, 0, header)
            ):
                log.error("the checkpoint names a held message at offset %d that the message log does not hold", offset)
                continue
            (sm,) = scan_batch(record[RECORD_HEADER_BYTES:])
            self.add(Held(due_ms, offset, size, dedup_key(sm)))


class Releasing(Appending, Protocol):
    """What releasing held messages needs of the store that holds them."""

    held: HeldMessages
    mlog: MessageLog
    limits: Limits
    sync_policy: bool
    flushed_offset: int


def release_due(store: Releasing, now_ms: int, max_n: int = RELEASE_BATCH_MAX) -> tuple[AppendResult, bool] | None:
    """Append copies of up to ``max_n`` held records due by ``now_ms`` to their subjects.

    Returns the append's result and whether the copies are visible already (every held
    record is fsynced, or the flush policy is periodic); None when nothing is due.
    """
    due = store.held.take_due(now_ms, max_n)
    if not due:
        return None
    try:
        records = read_spans(store.mlog, [(h.offset, h.size) for h in due])
    except OSError as exc:  # a failing disk: they stay held (and in the next checkpoint), tried again later
        for h in due:
            store.held.add(h)
        raise StoreError(
            f"reading {len(due)} held message(s) to release them failed ({exc}); they stay held and are tried again"
        ) from exc
    messages: list[bytes] = []
    for h, record in zip(due, records, strict=True):
        if record is None:
            # only if the broker was down past the retention and its segment was deleted
            log.error("held message at offset %d is no longer in the message log; it is dropped", h.offset)
        else:
            messages.append(record[RECORD_HEADER_BYTES:])
    if not messages:
        return None
    durable = not store.sync_policy or max(h.offset + h.size for h in due) <= store.flushed_offset
    body = b"".join(messages)
    try:
        result = store.append(
            body, scan_batch(body, store.limits), dedup_check=False, now_ms=now_ms, visible_now=durable
        )
    except BaseException:
        # a full or failing disk refused the copies: they stay held (and in the next checkpoint),
        # tried again later; forgotten here, nothing would release them, nor after a restart
        for h in due:
            store.held.add(h)
        raise
    if result.errors:
        # copies of what this broker stored itself: refused only if the limits changed since
        log.error("held messages could not be released: %s", result.errors[:3])
    return result, durable


def read_spans(mlog: MessageLog, spans: list[tuple[int, int]]) -> list[bytes | None]:
    """The records at (offset, size) spans, in the order given (None where the log lacks one);
    adjacent spans are read together."""
    out: list[bytes | None] = [None] * len(spans)
    order = sorted(range(len(spans)), key=lambda i: spans[i][0])
    i = 0
    while i < len(order):
        start, end = spans[order[i]][0], sum(spans[order[i]])
        j = i + 1
        while j < len(order) and spans[order[j]][0] == end and end - start < _READ_BYTES_MAX:
            end += spans[order[j]][1]
            j += 1
        if mlog.start <= start and end <= mlog.end:
            chunks: list[bytes] = []
            try:
                mlog.read_into(start, end - start, chunks)
            except QmqError:
                chunks = []
            data = b"".join(chunks)
            if len(data) == end - start:
                for k in order[i:j]:
                    offset, size = spans[k]
                    out[k] = data[offset - start : offset - start + size]
        i = j
    return out
