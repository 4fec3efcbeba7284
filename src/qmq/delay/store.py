"""The delay server's store: its data directory, the write-ahead log, the checks a send's
messages pass, and checkpoints; the schedule logs of its time buckets are its ``Schedule``.

Directory layout under ``data_dir``::

    LOCK                   held (flock) by the one delay server using this directory
    checkpoint             what the schedule logs cover (checkpoint.py)
    wal/<base>.log         the write-ahead log: records exactly like a broker's message log
                           (qmq.store.message_log); a record's sequence counts the messages before it
    schedule/<start_ms>/   the schedule log of one time bucket (bucket.py; all of them: schedule.py)
    resync/                a slave's copy of its master's schedule, staged (resync.py)
    resync.installing      there while that copy is swapped in: a start that finds it begins empty

A send frame's accepted messages are appended to the write-ahead log with one write (the
server acknowledges them once that is durable), then replayed at once, in order, into their
buckets (schedule.py). A checkpoint writes every buffer, fsyncs the schedule logs written
since the last one and then records the write-ahead log offset they cover, with each bucket's
sizes; write-ahead log segments wholly before that offset are deleted. Recovery (recovery.py)
builds the schedule again: it cuts buckets back to the checkpoint and replays the write-ahead
log from its offset.

Everything here is synchronous and runs on the server's event loop, except what
``CheckpointJob.run`` does on a worker thread.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

import crc32c
import numpy as np
import numpy.typing as npt

from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import DelayConfig
from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.common.naming import check_subject
from qmq.delay import cancel, repeat
from qmq.delay.bucket import Bucket
from qmq.delay.checkpoint import BucketMark, CheckpointJob, DelayCheckpoint, read_delay_checkpoint
from qmq.delay.ids import IDS_DTYPE
from qmq.delay.recovery import DelayParts, empty_parts, recover
from qmq.delay.resync import STAGING_DIR, remove_tree
from qmq.delay.schedule import SCHEDULE_DIR
from qmq.delay.timer import ROW, Rows
from qmq.protocol.codes import Status
from qmq.protocol.message import FLAG_REPEAT, FLAGS_POS, ScannedMessage
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store import fileio
from qmq.store.checkpoint import NAME as CHECKPOINT_FILE
from qmq.store.checkpoint import write_checkpoint
from qmq.store.datadir import DataDirLock, StoreError, store_error
from qmq.store.file_header import header
from qmq.store.message_log import FILE_KIND, SEGMENT_SUFFIX, MessageLog

log = logging.getLogger(__name__)

DAY_MS = 86_400_000
WAL_DIR = "wal"
INSTALLING = "resync.installing"
# Subjects checked once and remembered by their bytes; cleared when full so memory stays bounded.
_SUBJECTS_CACHED_MAX = 10_000
# Taken past the horizon by this much: a sender's clock (which set deliver_at) may run ahead of
# this server's, if only by the millisecond a delay of exactly horizon_days rounds up to
HORIZON_SLACK_MS = 60_000


class AppendResult(NamedTuple):
    errors: list[list[Any]]  # [index, status, text]
    stored: int
    stored_bytes: int
    arrivals: Rows  # rows for the timer: accepted messages of loaded buckets


class DelayStore:
    def __init__(self, config: DelayConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.bucket_ms = config.bucket_length_ms
        self.horizon_ms = config.horizon_days * DAY_MS
        self.dir = Path(config.data_dir)
        fileio.from_environment()  # a fault plan or an I/O trace (fileio.py), when the process has one
        fileio.make_dirs(self.dir)
        self._lock = DataDirLock(self.dir, "delay server")
        self.sync_policy = config.flush == "sync"
        self.wal = MessageLog(self.dir / WAL_DIR, config.wal_segment_bytes)
        # why the schedule logs can no longer be trusted (a failed fsync or write); None while they can
        self.failed: str | None = None
        # told when they cannot: the server stops taking sends until a restart
        self.on_disk_error: Callable[[BaseException], None] | None = None
        self._subjects: dict[bytes, bool] = {}
        # subjects seen for the first time (since the cache was last cleared): the server looks
        # up their routes before their messages come due; it empties the list
        self.new_subjects: list[str] = []
        # told when the write-ahead log or a dispatch log grew (the replication source wakes its slaves)
        self.on_grow: Callable[[], None] = _nothing
        self._install(empty_parts(config, clock))

    def _install(self, parts: DelayParts) -> None:
        self.schedule = parts.schedule
        self.wal_messages = parts.wal_messages
        parts.schedule.on_failure = self._schedule_failed
        self.find_dispatch_starts()

    def find_dispatch_starts(self) -> None:
        """Note every bucket whose dispatch log holds entries (``dispatch_starts``: what a master
        sends its slaves of its dispatch logs is looked for there, not in every bucket)."""
        self.dispatch_starts = {b.start_ms for b in self.schedule.iter_buckets() if b.dispatched}

    def _schedule_failed(self, exc: BaseException) -> None:
        """A schedule log failed to write or fsync (may run on the checkpoint's thread)."""
        if self.failed is None:
            self.failed = str(exc)
            log.critical("the delay server's schedule logs failed (%s); a restart rebuilds them", exc)
        if self.on_disk_error is not None:
            self.on_disk_error(exc)

    def open(self) -> dict[str, Any]:
        """Recover whatever state the last stop left (recovery.py); returns a report."""
        remove_tree(self.dir / STAGING_DIR)  # a copy staged but never swapped in: begun anew if needed
        if (self.dir / INSTALLING).exists():
            log.error(
                "%s was cut short while swapping in a copy of its master's schedule: it starts empty and "
                "copies its master anew",
                self.dir,
            )
            self.wal.close()
            self._wipe()
            self.wal = self._empty_wal(0)
            fileio.unlink(self.dir / INSTALLING)
        parts, report = recover(self.config, self.clock, self.wal)
        self._install(parts)
        return report

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
        horizon_end = now + self.horizon_ms + HORIZON_SLACK_MS
        known = self._subjects
        errors: list[list[Any]] = []
        accepted: list[ScannedMessage] = []
        # copies of repeating messages (repeat.py), by the index of the message in ``accepted``
        copies: dict[int, list[tuple[bytes, int]]] = {}
        view = memoryview(body)
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
            if body[sm.pos + FLAGS_POS] & FLAG_REPEAT:
                made = repeat.copies(view[sm.pos : sm.pos + length], now, horizon_end, self.config.horizon_days, limits)
                if isinstance(made, str):
                    errors.append([i, Status.INVALID_MESSAGE, made])
                    continue
                copies[len(accepted)] = made
                accepted.append(sm)
                total += sum(RECORD_HEADER_BYTES + len(c) for c, _due in made)
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
        pos = 0
        seq = self.wal_messages
        due_list: list[int] = []
        size_list: list[int] = []
        hash_list: list[int] = []  # of each id, for the buckets' id files (ids.py)
        crc = crc32c.crc32c
        for k, sm in enumerate(accepted):
            these = copies.get(k) if copies else None
            if these is None:
                p = sm.pos
                pos = pack_record_into(out, pos, view[p : p + sm.length], seq, now)
                seq += 1
                due_list.append(sm.deliver_at_ms)
                size_list.append(sm.length)
                hash_list.append(crc(sm.message_id))
                continue
            h = crc(sm.message_id)
            for copy, due in these:
                pos = pack_record_into(out, pos, copy, seq, now)
                seq += 1
                due_list.append(due)
                size_list.append(len(copy))
                hash_list.append(h)
        try:
            self.wal.append(out)
        except OSError as exc:
            raise store_error(exc, self.dir) from exc
        n = seq - self.wal_messages
        self.wal_messages = seq
        self.on_grow()
        dues = np.fromiter(due_list, dtype=np.int64, count=n)
        sizes = np.fromiter(size_list, dtype=np.int64, count=n) + RECORD_HEADER_BYTES
        rows = self.replay(out, dues, sizes, now, base, np.array(hash_list, dtype=IDS_DTYPE))
        # a schedule-log write failing here loses nothing: the write-ahead log holds the messages and
        # a later flush writes them (schedule.py); the send is stored and answered as such
        with contextlib.suppress(StoreError):
            self.schedule.after_replay()
        return AppendResult(errors, n, total, rows)

    def cancel_search(self, message_id: str) -> Callable[[], dict[int, cancel.Written]]:
        """The part of a cancel of ``message_id`` that reads what the buckets have written: a
        job for a worker thread, whose result ``cancel`` takes (cancel.py)."""
        self.schedule.flush_deferred()  # messages of far buckets waiting for the flush are searched too
        buckets = cancel.snapshot(list(self.schedule.iter_buckets()))
        return functools.partial(cancel.search_written, buckets, message_id.encode("utf-8"))

    def cancel(
        self, message_id: str, live: cancel.Live | None, written: dict[int, cancel.Written] | None = None
    ) -> int:
        """Cancel the pending messages with ``message_id`` (cancel.py), after the search of
        ``cancel_search`` when given; returns how many entries it stopped (0: none pending,
        nothing written). Once it returns more, the cancel is in the write-ahead log: answer it
        once that is durable, as for a send."""
        mid = message_id.encode("utf-8")
        schedule = self.schedule
        schedule.flush_deferred()  # messages of far buckets waiting for the flush are searched too
        try:
            stops = cancel.pending_entries(list(schedule.iter_buckets()), mid, live, written)
        except OSError as exc:
            raise store_error(exc, self.dir) from exc
        if not stops:
            return 0
        now = self.clock.now_ms()
        message = cancel.cancel_record(mid, now)
        record = bytearray(RECORD_HEADER_BYTES + len(message))
        pack_record_into(record, 0, message, self.wal_messages, now)
        self.wal.offset_for_append(len(record))
        try:
            self.wal.append(record)
        except OSError as exc:
            raise store_error(exc, self.dir) from exc
        self.wal_messages += 1
        self.on_grow()
        self.dispatch_starts.update(b.start_ms for b, _entries in stops)
        try:
            return cancel.apply(stops, live, schedule.note_cancelled)
        except OSError as exc:
            # the write-ahead log holds the cancel: a restart's recovery applies it again
            raise StoreError(
                f"cannot write the dispatch log of a cancelled message: {exc}; restart the delay server"
            ) from exc

    def beyond_horizon(self, deliver_at_ms: int, now_ms: int) -> str:
        when = _iso(deliver_at_ms)
        days = (deliver_at_ms - now_ms) / DAY_MS
        return (
            f"deliver_at {when} is {days:,.1f} days ahead; the horizon is {self.config.horizon_days} days "
            "(horizon_days): send it later, or raise horizon_days on the delay server"
        )

    def replay(
        self,
        records: bytearray,
        dues: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        stored_ms: Any,
        base: int,
        id_hashes: npt.NDArray[np.uint32] | None = None,
    ) -> Rows:
        """Add write-ahead log records to their buckets (``Schedule.replay``). ``append`` calls it
        through the store so ``bench.delay_intake`` can time the replay step alone."""
        return self.schedule.replay(records, dues, sizes, stored_ms, base, id_hashes)

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_job(self) -> CheckpointJob:
        """Write every buffer and capture the checkpoint; the job's ``run`` makes it durable.

        StoreError once a schedule log failed: a checkpoint names sizes it vouches are durable."""
        if self.failed is not None:
            raise StoreError(
                f"the delay server's schedule logs failed ({self.failed}); it writes no checkpoint: restart it, "
                "and recovery rebuilds them from the write-ahead log"
            )
        schedule = self.schedule
        schedule.flush_buffers()
        paths = schedule.take_written_paths()
        checkpoint = DelayCheckpoint(
            self.clock.now_ms(),
            self.wal.end,
            self.wal_messages,
            self.bucket_ms,
            [BucketMark.of(b) for b in schedule.iter_buckets()],
        )
        return CheckpointJob(self.dir, paths, checkpoint, self._schedule_failed)

    def after_checkpoint(self, job: CheckpointJob, keep_from: int | None = None) -> int:
        """The checkpoint is durable: delete write-ahead log segments it covers, except from
        ``keep_from`` on (what a slave has not copied yet), unless that would keep more than
        ``wal_kept_for_slaves_bytes_max``; returns how many."""
        covered = self.schedule.checkpointed(job.wal_offset)
        if keep_from is not None and self.wal.end - keep_from <= self.config.wal_kept_for_slaves_bytes_max:
            covered = min(covered, keep_from)
        return len(self.wal.segments.delete_before(covered))

    def rewind(self, wal_offset: int) -> dict[str, Any]:
        """Cut the write-ahead log back to ``wal_offset`` (where the group's new master's copy
        began: a demoted master's later records were never acknowledged), and the schedule logs
        with it, then recover (recovery.py); returns recovery's report.

        When the checkpoint covers records being cut, the schedule logs are rebuilt from the
        write-ahead log's start (their dispatch logs then come again from the master); if that
        start is gone, StoreError says what to do."""
        checkpoint = read_delay_checkpoint(self.dir)
        covered = 0 if checkpoint is None else checkpoint.wal_offset
        rebuild = covered > wal_offset
        # refused before anything is cut: else the schedule logs would keep the cut records, and
        # the follow order, coming again, would find the log cut already and copy on top of them
        if rebuild and self.wal.start > 0:
            raise StoreError(
                f"cannot cut this delay server's copy back to write-ahead log offset {wal_offset}: its checkpoint "
                f"covers records up to {covered} and its log no longer begins at 0; stop it, move "
                f"{self.dir} away and start it again as a slave (--role slave) to copy its master anew"
            )
        cut = self.wal.truncate(min(wal_offset, self.wal.end))
        if rebuild:
            for b in list(self.schedule.iter_buckets()):
                self.schedule.remove_bucket(b)
            fileio.unlink(self.dir / CHECKPOINT_FILE, missing_ok=True)
        self.schedule.close()
        fileio.sync()
        log.warning("cut %d bytes of the write-ahead log at offset %d; recovering", cut, wal_offset)
        return self.open()

    def install_copy(self, staging: Path, checkpoint: DelayCheckpoint) -> dict[str, Any]:
        """Swap a copy of a master's schedule (staged by resync.py under ``staging``, its buckets as
        ``checkpoint`` names them) in for this store's, with an empty write-ahead log beginning at
        the checkpoint's offset; returns recovery's report. A crash midway leaves the marker
        ``INSTALLING``: the next ``open`` begins empty."""
        fileio.replace_file(self.dir / INSTALLING, b"")
        self.schedule.close()
        self.wal.close()
        self._wipe()
        fileio.replace(staging / SCHEDULE_DIR, self.dir / SCHEDULE_DIR)
        write_checkpoint(self.dir, checkpoint.to_state())
        self.wal = self._empty_wal(checkpoint.wal_offset)
        remove_tree(staging)
        fileio.unlink(self.dir / INSTALLING)
        fileio.fsync_dir(self.dir)
        return self.open()

    def _wipe(self) -> None:
        """Delete the schedule logs, the checkpoint and the write-ahead log (closed first)."""
        fileio.unlink(self.dir / CHECKPOINT_FILE, missing_ok=True)
        remove_tree(self.dir / SCHEDULE_DIR)
        remove_tree(self.dir / WAL_DIR)

    def _empty_wal(self, base: int) -> MessageLog:
        """A write-ahead log holding nothing, whose first segment begins at offset ``base``."""
        directory = self.dir / WAL_DIR
        fileio.make_dirs(directory)
        fd = fileio.open(directory / f"{base:020d}{SEGMENT_SUFFIX}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
        try:
            fileio.write_all(fd, header(FILE_KIND))
            fileio.fsync(fd)
        finally:
            fileio.close(fd)
        fileio.fsync_dir(directory)
        return MessageLog(directory, self.config.wal_segment_bytes)

    def close(self) -> None:
        self.schedule.close()
        self.wal.close()
        self._lock.release()

    # -- the schedule's, for callers holding the store (the server, its handlers and metrics,
    # -- and the scheduler it is given: see scheduler.Buckets)

    @property
    def buckets(self) -> dict[int, Bucket]:
        return self.schedule.buckets

    @property
    def starts(self) -> list[int]:
        return self.schedule.starts

    @property
    def pending_total(self) -> int:
        return self.schedule.pending_total

    @property
    def buffered_bytes(self) -> int:
        return self.schedule.buffered_bytes

    @property
    def dispatch_entries_damaged(self) -> int:
        return self.schedule.dispatch_entries_damaged

    @property
    def deferred_from_ms(self) -> int | None:
        return self.schedule.deferred_from_ms

    @property
    def created_bucket(self) -> bool:
        return self.schedule.created_bucket

    @created_bucket.setter
    def created_bucket(self, value: bool) -> None:
        self.schedule.created_bucket = value

    def iter_buckets(self) -> Iterator[Bucket]:
        return self.schedule.iter_buckets()

    def flush_deferred(self) -> None:
        self.schedule.flush_deferred()

    def flush_buffers(self) -> int:
        return self.schedule.flush_buffers()

    def take_sync_due(self) -> list[Path]:
        return self.schedule.take_sync_due()

    def finished_buckets(self, now_ms: int) -> list[Bucket]:
        return self.schedule.finished_buckets(now_ms)

    def remove_bucket(self, b: Bucket) -> None:
        self.schedule.remove_bucket(b)
        self.dispatch_starts.discard(b.start_ms)

    def dispatched(self, start_ms: int, entries: bytes) -> int:
        n = self.schedule.dispatched(start_ms, entries)
        if n:
            self.dispatch_starts.add(start_ms)
        self.on_grow()
        return n


def _nothing() -> None:
    pass


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
