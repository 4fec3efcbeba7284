"""The schedule logs of a delay store's time buckets, taken together: which buckets there are
(by start, and their starts in order), how write-ahead log records get into them, and what of
them is written and durable.

A message belongs to the bucket of ``max(due, stored time)``, so a message already due joins
the current bucket and no message ever joins a past one. Records are replayed into their
buckets' buffers in write-ahead log order (``replay``): a batch due within one bucket as one
run, numpy all the way; a batch spread over buckets bucket by bucket, except that the messages
of far buckets wait for the next flush and are sorted in then in bulk (far.py), as do those of
a batch within one far bucket while any wait: every bucket takes its messages in log order,
whatever the batches, so a slave's or recovery's replay gives each the entry number it has here. A loaded
bucket's records are written at once, since they are read as soon as they are due; other
buffers are written when they pass ``schedule_buffer_bytes_max`` and before every checkpoint.
Files written ``sync_bytes`` past their last fsync are handed to the server to fsync in the
background (``take_sync_due``); a checkpoint fsyncs what was written since the last one
(``take_written_paths``) and, once durable, lets finished buckets be deleted.

Schedule logs are derived from the write-ahead log, so a write that fails loses nothing: the
bucket keeps its buffer and the next flush writes it. A full disk clears by itself; any other
failure is reported to ``on_failure`` (the server stops taking sends until a restart, whose
recovery rebuilds the schedule logs from the write-ahead log).

Synchronous; runs on the server's event loop.
"""

from __future__ import annotations

import bisect
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qmq.common.clock import Clock
from qmq.common.config import DelayConfig
from qmq.delay.bucket import INDEX_ENTRY_BYTES, Bucket, bucket_start_of
from qmq.delay.far import FarMessages
from qmq.delay.ids import IDS_DTYPE, record_id_hashes
from qmq.delay.timer import ROW, Rows, make_rows
from qmq.store import fileio
from qmq.store.datadir import StoreError, clears_by_itself, store_error

log = logging.getLogger(__name__)

SCHEDULE_DIR = "schedule"
# Buckets that keep their two append descriptors open between flushes: opening a file per
# flush per bucket would cost more than the writes when a backlog spreads over many buckets.
_WRITING_BUCKETS_MAX = 2_000
# A bucket's share of a batch this large is added with numpy; smaller shares message by message.
_RUN_ROWS_MIN = 32


class Schedule:
    """The time buckets under ``<data_dir>/schedule``, and counts over all of them."""

    def __init__(self, config: DelayConfig, clock: Clock) -> None:
        self.bucket_ms = config.bucket_length_ms
        self._data_dir = Path(config.data_dir)  # named in write errors
        self.directory = self._data_dir / SCHEDULE_DIR
        fileio.make_dirs(self.directory)
        self._buffer_bytes_max = config.schedule_buffer_bytes_max
        self._sync_bytes = config.sync_bytes
        self.buckets: dict[int, Bucket] = {}
        self.starts: list[int] = []  # bucket starts, sorted
        self.buffered_bytes = 0
        self.pending_total = 0  # messages not yet acknowledged by a broker, over every bucket
        self._dispatch_damaged_removed = 0  # dispatch_damaged of buckets deleted since the start
        # the write-ahead log offset the last durable checkpoint covers
        self.checkpointed_offset = 0
        self.created_bucket = False  # set when a bucket is created; the server clears it
        self._new_dirs = False
        self.far = FarMessages(clock, config.preload_ms, config.checkpoint_interval_ms)
        # buckets whose schedule-log descriptors stay open between flushes, least recent first
        self._writers: OrderedDict[int, Bucket] = OrderedDict()
        # two descriptors each, within a quarter of what the process may open beyond connections
        soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._writers_max = max(16, min(_WRITING_BUCKETS_MAX, (soft_fds - config.connections_max) // 8))
        # files of buckets written sync_bytes past their last fsync: the server fsyncs them in
        # the background (take_sync_due), so a checkpoint never meets a burst's worth at once
        self._sync_due: dict[Path, None] = {}
        # told of a failed write that does not clear by itself (see the module docstring)
        self.on_failure: Callable[[StoreError], None] = lambda _exc: None

    # -- buckets -----------------------------------------------------------------------

    def bucket(self, start_ms: int) -> Bucket:
        """The bucket starting at ``start_ms``, created if new."""
        b = self.buckets.get(start_ms)
        if b is None:
            b = Bucket(self.directory, start_ms)
            b.create()
            self.buckets[start_ms] = b
            bisect.insort(self.starts, start_ms)
            self._new_dirs = True
            self.created_bucket = True
        return b

    def existing_bucket_starts(self) -> list[int]:
        """Starts of the bucket directories on disk."""
        out = []
        for name in fileio.listdir(self.directory):
            start = bucket_start_of(name)
            if start is None:
                log.warning("ignoring %s in the schedule directory: not a time bucket", self.directory / name)
                continue
            out.append(start)
        return sorted(out)

    def iter_buckets(self) -> Iterator[Bucket]:
        """Buckets in time order."""
        for start in list(self.starts):
            b = self.buckets.get(start)
            if b is not None:
                yield b

    def remove_bucket(self, b: Bucket) -> None:
        self._writers.pop(b.start_ms, None)
        b.remove()
        self.buckets.pop(b.start_ms, None)
        i = bisect.bisect_left(self.starts, b.start_ms)
        if i < len(self.starts) and self.starts[i] == b.start_ms:
            self.starts.pop(i)
        self.buffered_bytes -= b.buffered_bytes
        self.pending_total -= b.pending
        self._dispatch_damaged_removed += b.dispatch_damaged

    @property
    def dispatch_entries_damaged(self) -> int:
        """Dispatch-log entries dropped since the start because their CRC failed (each file once)."""
        return self._dispatch_damaged_removed + sum(b.dispatch_damaged for b in self.buckets.values())

    def finished_buckets(self, now_ms: int) -> list[Bucket]:
        """Buckets that can be deleted: past, every message acknowledged, and covered by a checkpoint
        (so a replay after a crash can never bring one of their messages back)."""
        out = []
        for b in self.iter_buckets():
            if b.start_ms + self.bucket_ms > now_ms:
                break
            if b.dispatched >= b.count and not b.pending_messages and b.wal_end <= self.checkpointed_offset:
                out.append(b)
        return out

    def dispatched(self, start_ms: int, entries: bytes) -> int:
        """Record entries of one bucket (the dispatch log's layout) as acknowledged by a broker;
        returns how many (none when the bucket is gone)."""
        b = self.buckets.get(start_ms)
        if b is None:
            return 0
        before = b.dispatched
        try:
            b.append_dispatch(entries)
        except OSError as exc:
            raise StoreError(f"cannot write the dispatch log of time bucket {start_ms}: {exc}") from exc
        n = b.dispatched - before
        self.pending_total -= n
        return n

    def note_cancelled(self, n: int) -> None:
        """``n`` pending entries were cancelled (written to their dispatch logs)."""
        self.pending_total -= n

    # -- replay ------------------------------------------------------------------------

    def replay(
        self,
        records: bytearray,
        dues: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        stored_ms: Any,
        base: int,
        id_hashes: npt.NDArray[np.uint32] | None = None,
    ) -> Rows:
        """Add write-ahead log records (``records``, back to back, from offset ``base``) to their
        buckets, each bucket's in log order; returns the timer rows of those in loaded buckets.

        ``stored_ms`` is the records' stored time, one for all or an array of one per record;
        ``id_hashes`` the hashes of their ids for the id files (ids.py), read from the records
        when not given.
        """
        if id_hashes is None:
            id_hashes = np.frombuffer(record_id_hashes(records, sizes), dtype=IDS_DTYPE)
        n = len(dues)
        ends = np.cumsum(sizes)
        due_or_stored = np.maximum(dues, stored_ms)
        starts = due_or_stored - due_or_stored % self.bucket_ms
        first = int(starts[0])
        view = memoryview(records)
        self.buffered_bytes += int(ends[-1]) + INDEX_ENTRY_BYTES * n
        self.pending_total += n
        if n == 1 or bool((starts == first).all()):
            far_from = self.far.from_ms
            if far_from is not None and first > far_from and not self._loaded(first):
                # Messages of far buckets wait for the flush, maybe of this one: these join
                # them, so the bucket takes every message in write-ahead log order whatever
                # the batches were (a slave or recovery replays many sends as one run).
                self.far.add(view, base, dues, sizes, ends, starts, id_hashes)
                return np.empty(0, dtype=ROW)
            # the common case (a batch due within one bucket): one run, numpy all the way
            b = self.bucket(first)
            entry, offsets = b.add_run(view, dues, sizes, base + int(ends[-1]), id_hashes)
            if not b.loaded:
                return np.empty(0, dtype=ROW)
            rows = make_rows(first, dues, offsets, np.arange(entry, entry + n), sizes)
            self._write_through(b)
            return rows
        far = starts > self.far.cutoff_ms()
        if far.any():
            self.far.add(view, base, dues[far], sizes[far], ends[far], starts[far], id_hashes[far])
            if far.all():
                return np.empty(0, dtype=ROW)
            near = ~far
            dues, sizes, ends, starts, id_hashes = dues[near], sizes[near], ends[near], starts[near], id_hashes[near]
        return self._replay_spread(view, dues, sizes, ends, starts, base, id_hashes)

    def _loaded(self, start_ms: int) -> bool:
        b = self.buckets.get(start_ms)
        return b is not None and b.loaded

    def _replay_spread(
        self,
        view: memoryview,
        dues: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        base: int,
        id_hashes: npt.NDArray[np.uint32],
    ) -> Rows:
        """A batch due across many buckets (few messages in each): plain Python per message."""
        by_bucket: dict[int, list[int]] = {}
        for i, start in enumerate(starts.tolist()):
            at = by_bucket.get(start)
            if at is None:
                by_bucket[start] = [i]
            else:
                at.append(i)
        dues_l, sizes_l, ends_l, hashes_l = dues.tolist(), sizes.tolist(), ends.tolist(), id_hashes.tolist()
        arrivals: list[tuple[int, int, int, int, int]] = []
        for start, members in by_bucket.items():
            b = self.bucket(start)
            if len(members) >= _RUN_ROWS_MIN:
                idx = np.array(members, dtype=np.intp)
                run = b"".join([view[e - z : e] for z, e in zip(sizes[idx].tolist(), ends[idx].tolist(), strict=True)])
                entry, offsets = b.add_run(run, dues[idx], sizes[idx], base + ends_l[members[-1]], id_hashes[idx])
                if b.loaded:
                    rows = make_rows(start, dues[idx], offsets, np.arange(entry, entry + len(idx)), sizes[idx])
                    arrivals.extend(rows.tolist())
                    self._write_through(b)
                continue
            for i in members:
                end = ends_l[i]
                size = sizes_l[i]
                entry, offset = b.add(view[end - size : end], dues_l[i], base + end, hashes_l[i])
                if b.loaded:
                    arrivals.append((dues_l[i], start, offset, entry, size))
            if b.loaded:
                self._write_through(b)
        return np.array(arrivals, dtype=ROW) if arrivals else np.empty(0, dtype=ROW)

    def flush_deferred(self) -> None:
        """Sort the messages of far buckets waiting for the flush into their buckets' buffers."""
        for run in self.far.take_runs():
            b = self.bucket(run.start_ms)
            if b.loaded:  # never: a bucket is loaded only after a flush (the scheduler's begin_load)
                raise StoreError(f"time bucket {run.start_ms} was loaded while messages for it waited to be written")
            b.add_run(run.records, run.dues, run.sizes, run.wal_end, run.id_hashes)

    @property
    def deferred_from_ms(self) -> int | None:
        """Buckets starting after this wait for the next flush; None while none can be waiting."""
        return self.far.from_ms

    # -- writing -----------------------------------------------------------------------

    def after_replay(self) -> None:
        if self.buffered_bytes > self._buffer_bytes_max:
            self.flush_buffers()

    def flush_buffers(self) -> int:
        """Write every bucket's buffer to its schedule log; returns bytes written."""
        self.flush_deferred()
        written = 0
        if self.buffered_bytes:
            writers = self._writers
            for b in self.buckets.values():
                if b.pending_messages:
                    try:
                        written += b.flush()
                    except OSError as exc:
                        raise self._write_failed(b, exc) from exc
                    self._note_unsynced(b)
                    writers[b.start_ms] = b
                    writers.move_to_end(b.start_ms)
            while len(writers) > self._writers_max:
                writers.popitem(last=False)[1].close_writers()
        self.buffered_bytes = 0
        return written

    def _write_through(self, b: Bucket) -> None:
        """A loaded bucket's messages are read as soon as they are due: write them at once
        instead of holding them in memory."""
        held = b.buffered_bytes
        try:
            b.flush()
        except OSError as exc:
            # kept in the buffer, read from there when due, written by the next flush
            self._write_failed(b, exc)
            return
        self.buffered_bytes -= held
        self._note_unsynced(b)

    def _write_failed(self, b: Bucket, exc: OSError) -> StoreError:
        err = store_error(exc, self._data_dir)
        log.warning("writing the schedule log of time bucket %d failed (%s); its buffer is kept", b.start_ms, exc)
        if not clears_by_itself(err):
            self.on_failure(err)
        return err

    def _note_unsynced(self, b: Bucket) -> None:
        if b.unsynced_bytes >= self._sync_bytes:
            b.unsynced_bytes = 0
            self._sync_due.update(dict.fromkeys(b.file_paths()))

    def take_sync_due(self) -> list[Path]:
        """Files to fsync in the background now (see ``sync_bytes``); empties the list."""
        if not self._sync_due:
            return []
        paths, self._sync_due = list(self._sync_due), {}
        return paths

    def take_written_paths(self) -> list[Path]:
        """Files written since the last call, and the schedule directory if a bucket was created
        since: what a checkpoint fsyncs before it names their sizes."""
        paths: list[Path] = []
        for b in self.buckets.values():
            if b.dirty:
                paths.extend(b.file_paths())
                b.dirty = False
                b.unsynced_bytes = 0
        if self._new_dirs:
            paths.append(self.directory)
            self._new_dirs = False
        return paths

    def checkpointed(self, wal_offset: int) -> int:
        """A checkpoint covering the write-ahead log up to ``wal_offset`` is durable; returns the
        offset checkpoints now cover."""
        self.checkpointed_offset = max(self.checkpointed_offset, wal_offset)
        return self.checkpointed_offset

    def close(self) -> None:
        for b in self.buckets.values():
            b.close()
