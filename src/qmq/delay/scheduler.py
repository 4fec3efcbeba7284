"""What is loaded into the timer, what is due, and what a broker has acknowledged.

Synchronous and clock-free (every call takes ``now_ms``), so its rules are tested with a
manual clock: a bucket is loaded once its start is within ``preload_ms`` of now (past and
current buckets are always loaded); loading reads its index and drops the entries its
dispatch log holds. Due rows are read from the schedule logs with one ``pread`` per run of
adjacent records, each record's CRC checked, and handed to a broker as the producer encoded
them: ``deliver_at_ms`` tells the broker to hold one handed over before it is due, and the
unchanged id, subject and attempt let its duplicate window drop one handed over twice.
Acknowledged entries go to the bucket's dispatch log.

The scheduler reaches the time buckets through ``Buckets``: the store's ``Schedule`` (a test
may build one alone), or the delay store, which passes its own on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple, Protocol

import crc32c
import numpy as np

from qmq.delay.bucket import Bucket, read_index
from qmq.delay.timer import ROW, Rows, Timer, make_rows, sort_rows
from qmq.protocol.message import HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store.datadir import StoreError

log = logging.getLogger(__name__)

# Adjacent-enough records are read with one pread: gaps up to this are read and skipped...
_READ_GAP_BYTES_MAX = 16 * 1024
# ...and one read is at most this long (a single larger record is read alone).
_READ_BYTES_MAX = 1024 * 1024
_NO_RECORD = (0, 0, 0, 0, 0)
_NAMES_CACHED_MAX = 10_000


class Handover(NamedTuple):
    """Due messages ready for a broker, in the order of ``rows``."""

    rows: Rows
    subjects: list[str]
    encoded: list[bytes]
    message_ids: list[str]
    corrupt: Rows  # rows whose record failed its check: never handed over


class LoadJob:
    """The reading of one bucket's index and dispatch log into timer rows (thread-safe: files only)."""

    __slots__ = ("bucket", "dispatched_before", "entries", "error", "rows")

    def __init__(self, bucket: Bucket, entries: int, dispatched_before: int) -> None:
        self.bucket = bucket
        self.entries = entries
        self.dispatched_before = dispatched_before
        self.rows: Rows = np.empty(0, dtype=ROW)
        self.error: OSError | None = None

    def run(self) -> None:
        b = self.bucket
        entries = self.entries
        try:
            index = read_index(b.directory, entries)
            dispatched = b.read_dispatched()
        except OSError as exc:
            self.error = exc
            return
        keep = np.ones(entries, dtype=bool)
        keep[dispatched[dispatched < entries]] = False
        numbers = np.flatnonzero(keep)
        picked = index[numbers]
        rows = make_rows(b.start_ms, picked["due"], picked["offset"], numbers, picked["size"])
        self.rows = sort_rows(rows)


class Buckets(Protocol):
    """What the scheduler (and the metrics read through it) use of the time buckets: a
    ``Schedule``, or the delay store, which passes its own on."""

    @property
    def buckets(self) -> dict[int, Bucket]: ...
    @property
    def pending_total(self) -> int: ...
    @property
    def buffered_bytes(self) -> int: ...
    @property
    def dispatch_entries_damaged(self) -> int: ...
    @property
    def deferred_from_ms(self) -> int | None: ...
    def flush_deferred(self) -> None: ...
    def iter_buckets(self) -> Iterator[Bucket]: ...
    def finished_buckets(self, now_ms: int) -> list[Bucket]: ...
    def remove_bucket(self, b: Bucket) -> None: ...
    def dispatched(self, start_ms: int, entries: bytes) -> int: ...


class Scheduler:
    def __init__(self, store: Buckets, preload_ms: int) -> None:
        self.store = store
        self.preload_ms = preload_ms
        self.timer = Timer()
        self._subject_names: dict[bytes, str] = {}
        # entries of loaded buckets cancelled since they were loaded: their rows may still be in
        # the timer (or on their way there) and are dropped at hand-over (qmq.delay.cancel)
        self.cancelled: dict[int, set[int]] = {}
        # entries of a bucket in flight to a broker (the dispatcher's, once it runs)
        self.in_flight_of: Callable[[int], set[int]] = lambda _start_ms: set()

    # -- cancels (qmq.delay.cancel.Live) -----------------------------------------------

    def in_flight(self, start_ms: int) -> set[int]:
        return self.in_flight_of(start_ms)

    def cancel_loaded(self, start_ms: int, entries: list[int]) -> None:
        self.cancelled.setdefault(start_ms, set()).update(entries)

    def drop_cancelled(self, rows: Rows) -> Rows:
        """``rows`` without those of cancelled entries (already in their dispatch logs)."""
        if not self.cancelled or not len(rows):
            return rows
        keep = np.ones(len(rows), dtype=bool)
        for start, entries in self.cancelled.items():
            mine = rows["bucket"] == start
            if mine.any():
                keep &= ~(mine & np.isin(rows["entry"], np.fromiter(entries, dtype=np.uint32, count=len(entries))))
        return rows if keep.all() else rows[keep]

    # -- loading -----------------------------------------------------------------------

    def load_due(self, now_ms: int) -> int:
        """Load every bucket starting at or before ``now_ms + preload_ms``; returns rows loaded."""
        return sum(self.load(b) for b in self.to_load(now_ms))

    def to_load(self, now_ms: int) -> list[Bucket]:
        """Buckets starting at or before ``now_ms + preload_ms`` that are not loaded (or loading)."""
        limit = now_ms + self.preload_ms
        deferred_from = self.store.deferred_from_ms
        if deferred_from is not None and deferred_from <= limit:
            self.store.flush_deferred()  # checkpoints stalled: messages of buckets coming due wait
        out = []
        for b in self.store.iter_buckets():
            if b.start_ms > limit:
                break
            if not b.loaded:
                out.append(b)
        return out

    def next_load_ms(self) -> int | None:
        """When the next bucket not yet loaded must be: its start minus the preload window."""
        for b in self.store.iter_buckets():
            if not b.loaded:
                return b.start_ms - self.preload_ms
        return None

    def load(self, b: Bucket) -> int:
        """Put a bucket's undispatched messages into the timer; later arrivals join it as they come."""
        job = self.begin_load(b)
        job.run()
        return self.finish_load(job)

    def begin_load(self, b: Bucket) -> LoadJob:
        """Mark ``b`` loaded (arrivals from now on go to the timer) and capture what ``LoadJob.run``
        must read; the reading may run on a worker thread, then ``finish_load`` on the loop."""
        self.store.flush_deferred()
        try:
            b.flush()
        except OSError as exc:
            raise StoreError(f"cannot load time bucket {b.start_ms}: {exc}") from exc
        b.loaded = True
        return LoadJob(b, b.count, b.dispatched)

    def finish_load(self, job: LoadJob) -> int:
        b = job.bucket
        if job.error is not None:
            b.loaded = False
            self.cancelled.pop(b.start_ms, None)  # in the dispatch log: the next load skips them
            raise StoreError(f"cannot load time bucket {b.start_ms}: {job.error}")
        rows = job.rows
        # entries cancelled while the job read: in the dispatch log (counted in b.dispatched
        # since), whether or not the job saw them there
        late = [e for e in self.cancelled.get(b.start_ms, ()) if e < job.entries]
        if late:
            rows = rows[~np.isin(rows["entry"], np.asarray(late, dtype=np.uint32))]
        self.timer.add_sorted_main(rows)
        # the dispatch log is the truth for what was there; acks of later arrivals came on top
        b.dispatched = job.entries - len(rows) + (b.dispatched - job.dispatched_before - len(late))
        log.debug("loaded time bucket %d: %d of %d messages still due", b.start_ms, len(rows), job.entries)
        return len(rows)

    def unload_all(self) -> None:
        """Forget every loaded bucket (a master made slave: its copy may be cut back, and it no
        longer fires; once promoted again, buckets load from their files)."""
        for b in list(self.store.iter_buckets()):
            self.unload(b)
        self.cancelled.clear()

    def unload(self, b: Bucket) -> None:
        self.cancelled.pop(b.start_ms, None)
        if b.loaded:
            self.timer.drop_bucket(b.start_ms)
            b.loaded = False
            b.close()

    # -- firing --------------------------------------------------------------------------

    def next_due(self) -> int | None:
        return self.timer.next_due()

    def take(self, now_ms: int, rows_max: int, bytes_max: int) -> Rows:
        """Due rows, earliest first: at most ``rows_max`` and (beyond the first) ``bytes_max`` bytes."""
        rows = self.timer.take(now_ms, rows_max)
        if len(rows) > 1:
            sizes = np.cumsum(rows["size"], dtype=np.int64)
            fit = max(1, int(np.searchsorted(sizes, bytes_max, side="right")))
            if fit < len(rows):
                self.timer.add(rows[fit:])
                rows = rows[:fit]
        return rows

    def requeue(self, rows: Rows) -> None:
        """Rows whose hand-over failed: due again (at once, since their time has come)."""
        self.timer.add(rows)

    def read(self, rows: Rows) -> Handover:
        """Read the records of ``rows`` and make the messages a broker takes."""
        n = len(rows)
        encoded: list[bytes] = [b""] * n
        subjects: list[str] = [""] * n
        ids: list[str] = [""] * n
        bad: list[int] = []
        buckets = self.store.buckets
        names = self._subject_names
        unpack_record = RECORD_HEADER.unpack_from
        order = np.lexsort((rows["offset"], rows["bucket"]))
        starts = rows["bucket"][order].tolist()
        offsets = rows["offset"][order].tolist()
        sizes = rows["size"][order].tolist()
        positions = order.tolist()
        i = 0
        while i < n:
            start, run_off = starts[i], offsets[i]
            run_end = run_off + sizes[i]
            j = i + 1
            while (
                j < n
                and starts[j] == start
                and offsets[j] - run_end <= _READ_GAP_BYTES_MAX
                and offsets[j] + sizes[j] - run_off <= _READ_BYTES_MAX
            ):
                run_end = max(run_end, offsets[j] + sizes[j])
                j += 1
            b = buckets.get(start)
            if b is None:
                raise StoreError(f"time bucket {start} is gone while {j - i} of its messages are due")
            try:
                data = b.read(run_off, run_end - run_off)
            except OSError as exc:
                raise StoreError(f"cannot read the schedule log of time bucket {start}: {exc}") from exc
            view = memoryview(data)
            for k in range(i, j):
                p = offsets[k] - run_off
                size = sizes[k]
                at = positions[k]
                m = p + RECORD_HEADER_BYTES
                # the record's check, inline: this loop runs once per message handed over
                magic, crc, length, _seq, _ms = unpack_record(data, p) if m <= len(data) else _NO_RECORD
                if (
                    magic != RECORD_MAGIC
                    or length != size - RECORD_HEADER_BYTES
                    or length < HEADER_BYTES
                    or p + size > len(data)
                    or crc32c.crc32c(view[p + 8 : p + size]) != crc
                ):
                    log.error("time bucket %d: the record at offset %d fails its check; skipped", start, offsets[k])
                    bad.append(at)
                    continue
                # subj_len (u16 at 2) and id_l (u8 at 4) of the message header (qmq.protocol.message)
                slen = data[m + 2] | data[m + 3] << 8
                s = m + HEADER_BYTES
                raw_subject = bytes(view[s : s + slen])
                subject = names.get(raw_subject)
                if subject is None:
                    subject = self._subject_name(raw_subject)
                subjects[at] = subject
                ids[at] = str(view[s + slen : s + slen + data[m + 4]], "utf-8", "replace")
                encoded[at] = bytes(view[m : p + size])
            i = j
        if bad:
            keep = np.ones(n, dtype=bool)
            keep[bad] = False
            idx = np.flatnonzero(keep).tolist()
            return Handover(
                rows[keep], [subjects[x] for x in idx], [encoded[x] for x in idx], [ids[x] for x in idx], rows[~keep]
            )
        return Handover(rows, subjects, encoded, ids, rows[:0])

    def _subject_name(self, raw: bytes) -> str:
        name = raw.decode("utf-8", "replace")
        if len(self._subject_names) >= _NAMES_CACHED_MAX:
            self._subject_names.clear()
        self._subject_names[raw] = name
        return name

    # -- acknowledgements ----------------------------------------------------------------

    def dispatched(self, start_ms: int, entries: bytes) -> int:
        """Record entries of one bucket as handed over for good; returns how many."""
        return self.store.dispatched(start_ms, entries)

    def remove_finished(self, now_ms: int) -> list[int]:
        """Delete the buckets the store says are finished; returns their starts."""
        gone = []
        for b in self.store.finished_buckets(now_ms):
            self.unload(b)
            self.store.remove_bucket(b)
            gone.append(b.start_ms)
        return gone

    # -- stats ---------------------------------------------------------------------------

    def stats(self, buckets_max: int) -> dict[str, Any]:
        self.store.flush_deferred()  # into their buckets' buffers: counted per bucket
        rows: list[dict[str, Any]] = []
        next_due: int | None = self.timer.next_due()
        total = 0
        for b in self.store.iter_buckets():
            if b.loaded:
                held = self.timer.rows_of(b.start_ms)
                bucket_next: int | None = int(held["due"].min()) if len(held) else None
            else:
                bucket_next = b.min_due_ms if b.pending else None
                if bucket_next is not None and (next_due is None or bucket_next < next_due):
                    next_due = bucket_next
            total += 1
            if len(rows) < buckets_max:
                rows.append(
                    {
                        "start_ms": b.start_ms,
                        "messages": b.count,
                        "dispatched": b.dispatched,
                        "pending": b.pending,
                        "next_due_ms": bucket_next,
                        "loaded": b.loaded,
                    }
                )
        return {
            "pending": self.store.pending_total,
            "next_due_ms": next_due,
            "buckets_total": total,
            "buckets": rows,
            "timer_rows": len(self.timer),
            "timer_bytes": self.timer.nbytes,
        }
