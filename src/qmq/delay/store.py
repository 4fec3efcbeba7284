"""The delay server's store: its write-ahead log, the schedule logs of its time buckets, its checkpoint.

Directory layout under ``data_dir``::

    LOCK                   held (flock) by the one delay server using this directory
    checkpoint             qmq.store.checkpoint, holding {"version": 1, "wal_offset", "wal_messages",
                           "bucket_ms", "buckets": [[start_ms, bytes, entries, min_due_ms, wal_end], ...]}
    wal/<base>.log         the write-ahead log: records exactly like a broker's message log
                           (qmq.store.message_log); a record's sequence counts the messages before it
    schedule/<start_ms>/   the schedule log of one time bucket (bucket.py)

A send frame's accepted messages are appended to the write-ahead log with one write (the
server acknowledges them once that is durable), then replayed at once, in order, into the
buffers of their buckets: a message belongs to the bucket of ``max(due, stored time)``, so a
message already due joins the current bucket and no message ever joins a past one. Buffers
are written to the schedule logs when they pass ``schedule_buffer_bytes_max`` and before
every checkpoint. A checkpoint fsyncs the schedule logs written since the last one and then
records the write-ahead log offset they cover, with each bucket's sizes; write-ahead log
segments wholly before that offset are deleted. Recovery (recovery.py) cuts buckets back to
the checkpoint and replays the write-ahead log from its offset.

Everything here is synchronous and runs on the server's event loop, except what
``CheckpointJob.run`` does on a worker thread.
"""

from __future__ import annotations

import bisect
import logging
import resource
import struct
from collections import OrderedDict
from collections.abc import Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import DelayConfig
from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.common.naming import check_subject
from qmq.delay.bucket import INDEX_ENTRY_BYTES, Bucket, bucket_start_of, fsync_paths
from qmq.delay.timer import ROW, Rows
from qmq.protocol.codes import Status
from qmq.protocol.message import ScannedMessage
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store.checkpoint import write_checkpoint
from qmq.store.datadir import DataDirLock, StoreError, store_error
from qmq.store.message_log import MessageLog

log = logging.getLogger(__name__)

DAY_MS = 86_400_000
CHECKPOINT_VERSION = 1
# Subjects checked once and remembered by their bytes; cleared when full so memory stays bounded.
_SUBJECTS_CACHED_MAX = 10_000
DELIVER_AT = struct.Struct("<q")
DELIVER_AT_POS = 16  # of deliver_at_ms in an encoded message (qmq.protocol.message)
# Buckets that keep their two append descriptors open between flushes: opening a file per
# flush per bucket would cost more than the writes when a backlog spreads over many buckets.
_WRITING_BUCKETS_MAX = 2_000
# A bucket's share of a batch this large is added with numpy; smaller shares message by message.
_RUN_ROWS_MIN = 32
# A batch spread over many buckets (a backlog over weeks: a message or two per bucket) would
# be added message by message; the messages of buckets that cannot be loaded before the next
# flush wait as they arrived instead, and the flush sorts them into their buckets in bulk.
# "Cannot be loaded": starting later than preload_ms + checkpoint_interval_ms + this margin
# after the first of them arrived (every checkpoint flushes; a load flushes first anyway).
_DEFER_MARGIN_MS = 60_000



class AppendResult(NamedTuple):
    errors: list[list[Any]]  # [index, status, text]
    stored: int
    stored_bytes: int
    arrivals: Rows  # rows for the timer: accepted messages of loaded buckets


class CheckpointJob:
    """A checkpoint captured on the loop; ``run`` fsyncs and writes it on a worker thread."""

    __slots__ = ("directory", "paths", "state")

    def __init__(self, directory: Path, paths: list[Path], state: dict[str, Any]) -> None:
        self.directory = directory
        self.paths = paths
        self.state = state

    @property
    def wal_offset(self) -> int:
        return int(self.state["wal_offset"])

    def run(self) -> None:
        fsync_paths(self.paths)
        write_checkpoint(self.directory, self.state)


class DelayStore:
    def __init__(self, config: DelayConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.bucket_ms = config.bucket_length_ms
        self.horizon_ms = config.horizon_days * DAY_MS
        self.dir = Path(config.data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = DataDirLock(self.dir, "delay server")
        self.sync_policy = config.flush == "sync"
        self.wal = MessageLog(self.dir / "wal", config.wal_segment_bytes)
        self.schedule_dir = self.dir / "schedule"
        self.schedule_dir.mkdir(exist_ok=True)
        self.buckets: dict[int, Bucket] = {}
        self.starts: list[int] = []  # bucket starts, sorted
        self.wal_messages = 0
        self.checkpointed_offset = 0
        self.buffered_bytes = 0
        self.pending_total = 0  # messages not yet acknowledged by a broker, over every bucket
        self._subjects: dict[bytes, bool] = {}
        # subjects seen for the first time (since the cache was last cleared): the server looks
        # up their routes before their messages come due; it empties the list
        self.new_subjects: list[str] = []
        self._new_dirs = False
        # buckets whose schedule-log descriptors stay open between flushes, least recent first
        self._writers: OrderedDict[int, Bucket] = OrderedDict()
        # two descriptors each, within a quarter of what the process may open beyond connections
        soft_fds, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        self._writers_max = max(16, min(_WRITING_BUCKETS_MAX, (soft_fds - config.connections_max) // 8))
        self.created_bucket = False  # set when a bucket is created; the server clears it
        # messages of far buckets waiting for the next flush (replay): (records, base of the records
        # in the log, dues, sizes, ends within records, bucket starts), in log order
        self._deferred: list[tuple[memoryview, int, Any, Any, Any, Any]] = []
        # buckets starting after this wait while anything is deferred (fixed until the flush, so
        # no bucket takes some messages at once and earlier ones later)
        self.deferred_from_ms: int | None = None
        self._defer_margin_ms = config.preload_ms + config.checkpoint_interval_ms + _DEFER_MARGIN_MS
        # files of buckets written sync_bytes past their last fsync: the server fsyncs them in
        # the background (take_sync_due), so a checkpoint never meets a burst's worth at once
        self._sync_due: dict[Path, None] = {}

    def open(self) -> dict[str, Any]:
        """Recover whatever state the last stop left (recovery.py); returns a report."""
        from qmq.delay.recovery import recover

        return recover(self)

    # -- buckets -----------------------------------------------------------------------

    def bucket_start(self, due_ms: int, stored_ms: int) -> int:
        t = due_ms if due_ms > stored_ms else stored_ms
        return t - t % self.bucket_ms

    def bucket(self, start_ms: int) -> Bucket:
        """The bucket starting at ``start_ms``, created if new."""
        b = self.buckets.get(start_ms)
        if b is None:
            b = Bucket(self.schedule_dir, start_ms)
            b.create()
            self.buckets[start_ms] = b
            bisect.insort(self.starts, start_ms)
            self._new_dirs = True
            self.created_bucket = True
        return b

    def existing_bucket_starts(self) -> list[int]:
        """Starts of the bucket directories on disk."""
        out = []
        for path in self.schedule_dir.iterdir():
            start = bucket_start_of(path.name)
            if start is None:
                log.warning("ignoring %s in the schedule directory: not a time bucket", path)
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

    # -- sends -------------------------------------------------------------------------

    def _subject_problem(self, raw: bytes) -> str | None:
        if raw in self._subjects:
            return None
        try:
            name = check_subject(raw.decode("utf-8"), self.limits)
        except UnicodeDecodeError:
            return f"subject {raw[:60]!r} is not valid UTF-8"
        except InvalidSubjectError as exc:
            return str(exc)
        if len(self._subjects) >= _SUBJECTS_CACHED_MAX:
            self._subjects.clear()
        self._subjects[raw] = True
        if len(self.new_subjects) < _SUBJECTS_CACHED_MAX:
            self.new_subjects.append(name)
        return None

    def append(
        self, body: bytes, scanned: list[ScannedMessage], refused: Mapping[int, str] | None = None
    ) -> AppendResult:
        """Append the acceptable messages of one send frame to the write-ahead log with one write,
        replay them into their buckets, and refuse the rest by index (``refused``: messages the
        caller found unfit, with the reason)."""
        now = self.clock.now_ms()
        limits = self.limits
        size_max = limits.message_bytes_max
        id_max = limits.message_id_chars_max
        horizon_end = now + self.horizon_ms
        known = self._subjects
        errors: list[list[Any]] = []
        accepted: list[ScannedMessage] = []
        total = 0
        for i, sm in enumerate(scanned):
            if refused and i in refused:
                errors.append([i, Status.INVALID_MESSAGE, f"message {i} of the batch is refused: {refused[i]}"])
                continue
            if sm.subject not in known:
                problem = self._subject_problem(sm.subject)
                if problem is not None:
                    errors.append([i, Status.INVALID_SUBJECT, problem])
                    continue
            length = sm.length
            if length > size_max:
                errors.append(
                    [i, Status.MESSAGE_TOO_LARGE, f"message of {length} bytes exceeds message_bytes_max {size_max}"]
                )
                continue
            mid = sm.message_id
            if not mid or len(mid) > id_max:
                errors.append([i, Status.INVALID_MESSAGE, f"message id must be 1..{id_max} bytes"])
                continue
            if sm.tags and _tag_count(sm.tags) > limits.tags_max:
                errors.append([i, Status.INVALID_MESSAGE, f"message has more than tags_max {limits.tags_max} tags"])
                continue
            if sm.deliver_at_ms > horizon_end:
                errors.append([i, Status.INVALID_MESSAGE, self.beyond_horizon(sm.deliver_at_ms, now)])
                continue
            accepted.append(sm)
            total += RECORD_HEADER_BYTES + length
        if not accepted:
            return AppendResult(errors, 0, 0, np.empty(0, dtype=ROW))
        base = self.wal.offset_for_append(total)
        out = bytearray(total)
        view = memoryview(body)
        pos = 0
        seq = self.wal_messages
        for sm in accepted:
            p = sm.pos
            pos = pack_record_into(out, pos, view[p : p + sm.length], seq, now)
            seq += 1
        try:
            self.wal.append(out)
        except OSError as exc:
            raise store_error(exc, self.dir) from exc
        self.wal_messages = seq
        n = len(accepted)
        dues = np.fromiter([sm.deliver_at_ms for sm in accepted], dtype=np.int64, count=n)
        sizes = np.fromiter([sm.length for sm in accepted], dtype=np.int64, count=n) + RECORD_HEADER_BYTES
        rows = self.replay(out, dues, sizes, now, base)
        self.after_replay()
        return AppendResult(errors, n, total, rows)

    def replay(
        self, records: bytearray, dues: npt.NDArray[np.int64], sizes: npt.NDArray[np.int64], stored_ms: Any, base: int
    ) -> Rows:
        """Add write-ahead log records (``records``, back to back, from offset ``base``) to their
        buckets, each bucket's in log order; returns the timer rows of those in loaded buckets.

        ``stored_ms`` is the records' stored time, one for all or an array of one per record.
        """
        n = len(dues)
        ends = np.cumsum(sizes)
        due_or_stored = np.maximum(dues, stored_ms)
        starts = due_or_stored - due_or_stored % self.bucket_ms
        first = int(starts[0])
        view = memoryview(records)
        self.buffered_bytes += int(ends[-1]) + INDEX_ENTRY_BYTES * n
        self.pending_total += n
        if n == 1 or bool((starts == first).all()):
            # the common case (a batch due within one bucket): one run, numpy all the way
            b = self.bucket(first)
            entry, offsets = b.add_run(view, dues, sizes, base + int(ends[-1]))
            if not b.loaded:
                return np.empty(0, dtype=ROW)
            rows = _rows(first, entry, dues, offsets, sizes)
            self._write_through(b)
            return rows
        if self.deferred_from_ms is None:
            self.deferred_from_ms = self.clock.now_ms() + self._defer_margin_ms
        far = starts > self.deferred_from_ms
        if far.any():
            self._deferred.append((view, base, dues[far], sizes[far], ends[far], starts[far]))
            if far.all():
                return np.empty(0, dtype=ROW)
            near = ~far
            dues, sizes, ends, starts = dues[near], sizes[near], ends[near], starts[near]
        return self._replay_spread(view, dues, sizes, ends, starts, base)

    def flush_deferred(self) -> None:
        """Sort the deferred messages into their buckets' buffers: per bucket one run, in log order."""
        deferred, self._deferred = self._deferred, []
        self.deferred_from_ms = None
        if not deferred:
            return
        views = [d[0] for d in deferred]
        offsets = np.cumsum([0] + [len(v) for v in views[:-1]])
        buf = memoryview(b"".join(views))
        # each message: where it ends in buf and in the log; sorted by bucket, log order kept
        ends = np.concatenate([d[4] + off for d, off in zip(deferred, offsets.tolist(), strict=True)])
        log_ends = np.concatenate([d[4] + d[1] for d in deferred])
        dues = np.concatenate([d[2] for d in deferred])
        sizes = np.concatenate([d[3] for d in deferred])
        starts = np.concatenate([d[5] for d in deferred])
        order = np.argsort(starts, kind="stable")
        ends, log_ends, dues, sizes, starts = ends[order], log_ends[order], dues[order], sizes[order], starts[order]
        unique, first, counts = np.unique(starts, return_index=True, return_counts=True)
        ends_l, sizes_l = ends.tolist(), sizes.tolist()
        for start, i, k in zip(unique.tolist(), first.tolist(), counts.tolist(), strict=True):
            j = i + k
            run = b"".join([buf[e - z : e] for e, z in zip(ends_l[i:j], sizes_l[i:j], strict=True)])
            b = self.bucket(start)
            if b.loaded:  # never: a bucket is loaded only after a flush (the scheduler's begin_load)
                raise StoreError(f"time bucket {start} was loaded while messages for it waited to be written")
            b.add_run(run, dues[i:j], sizes[i:j], int(log_ends[j - 1]))

    def _write_through(self, b: Bucket) -> None:
        """A loaded bucket's messages are read as soon as they are due: write them at once
        instead of holding them in memory."""
        held = b.buffered_bytes
        try:
            b.flush()
        except OSError as exc:
            raise store_error(exc, self.dir) from exc
        self.buffered_bytes -= held
        self._note_unsynced(b)

    def _note_unsynced(self, b: Bucket) -> None:
        if b.unsynced_bytes >= self.config.sync_bytes:
            b.unsynced_bytes = 0
            self._sync_due.update(dict.fromkeys(b.file_paths()))

    def take_sync_due(self) -> list[Path]:
        """Files to fsync in the background now (see ``sync_bytes``); empties the list."""
        if not self._sync_due:
            return []
        paths, self._sync_due = list(self._sync_due), {}
        return paths

    def _replay_spread(
        self,
        view: memoryview,
        dues: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        ends: npt.NDArray[np.int64],
        starts: npt.NDArray[np.int64],
        base: int,
    ) -> Rows:
        """A batch due across many buckets (few messages in each): plain Python per message."""
        by_bucket: dict[int, list[int]] = {}
        for i, start in enumerate(starts.tolist()):
            at = by_bucket.get(start)
            if at is None:
                by_bucket[start] = [i]
            else:
                at.append(i)
        dues_l, sizes_l, ends_l = dues.tolist(), sizes.tolist(), ends.tolist()
        arrivals: list[tuple[int, int, int, int, int]] = []
        for start, members in by_bucket.items():
            b = self.bucket(start)
            if len(members) >= _RUN_ROWS_MIN:
                idx = np.array(members, dtype=np.intp)
                run = b"".join([view[e - z : e] for z, e in zip(sizes[idx].tolist(), ends[idx].tolist(), strict=True)])
                entry, offsets = b.add_run(run, dues[idx], sizes[idx], base + ends_l[members[-1]])
                if b.loaded:
                    arrivals.extend(_rows(start, entry, dues[idx], offsets, sizes[idx]).tolist())
                    self._write_through(b)
                continue
            for i in members:
                end = ends_l[i]
                size = sizes_l[i]
                entry, offset = b.add(view[end - size : end], dues_l[i], base + end)
                if b.loaded:
                    arrivals.append((dues_l[i], start, offset, entry, size))
            if b.loaded:
                self._write_through(b)
        return np.array(arrivals, dtype=ROW) if arrivals else np.empty(0, dtype=ROW)

    def after_replay(self) -> None:
        if self.buffered_bytes > self.config.schedule_buffer_bytes_max:
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
                        raise store_error(exc, self.dir) from exc
                    self._note_unsynced(b)
                    writers[b.start_ms] = b
                    writers.move_to_end(b.start_ms)
            while len(writers) > self._writers_max:
                writers.popitem(last=False)[1].close_writers()
        self.buffered_bytes = 0
        return written

    def beyond_horizon(self, deliver_at_ms: int, now_ms: int) -> str:
        when = _iso(deliver_at_ms)
        days = (deliver_at_ms - now_ms) / DAY_MS
        return (
            f"deliver_at {when} is {days:,.1f} days ahead; the horizon is {self.config.horizon_days} days "
            "(horizon_days): send it later, or raise horizon_days on the delay server"
        )

    # -- checkpoints and deletion -------------------------------------------------------

    def checkpoint_job(self) -> CheckpointJob:
        """Write every buffer and capture the checkpoint; the job's ``run`` makes it durable."""
        self.flush_buffers()
        paths: list[Path] = []
        for b in self.buckets.values():
            if b.dirty:
                paths.extend(b.file_paths())
                b.dirty = False
                b.unsynced_bytes = 0
        if self._new_dirs:
            paths.append(self.schedule_dir)
            self._new_dirs = False
        state = {
            "version": CHECKPOINT_VERSION,
            "time_ms": self.clock.now_ms(),
            "wal_offset": self.wal.end,
            "wal_messages": self.wal_messages,
            "bucket_ms": self.bucket_ms,
            "buckets": [b.summary() for b in self.iter_buckets()],
        }
        return CheckpointJob(self.dir, paths, state)

    def after_checkpoint(self, job: CheckpointJob) -> int:
        """The checkpoint is durable: delete write-ahead log segments it covers; returns how many."""
        self.checkpointed_offset = max(self.checkpointed_offset, job.wal_offset)
        return len(self.wal.segments.delete_before(self.checkpointed_offset))

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

    def close(self) -> None:
        for b in self.buckets.values():
            b.close()
        self.wal.close()
        self._lock.release()


def _rows(
    start_ms: int,
    entry: int,
    dues: npt.NDArray[np.int64],
    offsets: npt.NDArray[np.int64],
    sizes: npt.NDArray[np.int64],
) -> Rows:
    rows = np.empty(len(dues), dtype=ROW)
    rows["due"] = dues
    rows["bucket"] = start_ms
    rows["offset"] = offsets
    rows["entry"] = np.arange(entry, entry + len(dues))
    rows["size"] = sizes
    return rows


def _tag_count(tags_block: bytes) -> int:
    n = 0
    pos = 0
    while pos < len(tags_block):  # bounded: moves forward at least one byte per tag
        pos += 1 + tags_block[pos]
        n += 1
    return n


def _iso(epoch_ms: int) -> str:
    try:
        return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError):
        return f"{epoch_ms} ms after the epoch"

