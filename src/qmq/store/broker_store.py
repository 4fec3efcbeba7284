"""The broker's store: what a send appends, what a pull reads, what an ack records.

Directory layout under ``data_dir``::

    LOCK                      held (flock) by the one broker using this directory
    checkpoint                offsets, subjects and consumer progress (see checkpoint.py)
    log/<base>.log            message log segments (message_log.py)
    consume/<subject>/        one consume log per subject (consume_log.py); <subject> escaped
    action/<base>.act         action log segments (action_log.py)
    dead/<subject>/           dead letters (dead_letters.py)

The store owns the files and composes the parts that hold its state, each behind its own
interface: the subjects and their sequences (subjects.py), consumer progress kept through
the action log (action_log.ProgressLog), the duplicate window (dedup.py), the held messages
(held.py) and the reads for pulls (take.py). Recovery (recovery.py) builds the parts from
the files; no part knows the store.

Everything is synchronous. ``begin_flush`` returns a ticket whose ``run`` (fdatasync of the
files written since the last flush: message log, dead letters and action log) may run on
another thread; ``complete_flush`` then makes the flushed messages visible to consumers.

When a write fails, the store is left as it was before it: a send's batch is undone whole
(message log, consume logs and dead letters cut back, sequences restored, nothing in the
duplicate window), so the producer's retry stores it once. A full disk (``DiskFullError``) or
no free file descriptor (``OutOfFilesError``) clears by itself: the next write just works.
Any other I/O error, a failed fsync, or an undo that fails leaves the store unsure of what
is durable: it sets ``failed`` (the reason) and refuses every later write with a StoreError
saying a restart is needed (a StoreFailedError, retriable: nothing of it was written);
recovery then finds what is on disk.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, TypeVar

import crc32c

from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import BrokerConfig
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.protocol.message import FLAG_ORDERED, FLAGS_POS, ScannedMessage, order_slot_field
from qmq.protocol.record import RECORD_CRC, RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC, pack_record_into
from qmq.store import fileio
from qmq.store.action_log import ActionLog
from qmq.store.checkpoint import FORMAT_VERSION as CHECKPOINT_VERSION
from qmq.store.checkpoint import history as checkpoint_history
from qmq.store.checkpoint import read_checkpoint, write_checkpoint
from qmq.store.consume_log import ENTRY
from qmq.store.datadir import DataDirLock, StoreError, StoreFailedError, clears_by_itself, store_error
from qmq.store.dead_letters import DeadLetters
from qmq.store.group_filter import GroupFilter, dead_letter_unevaluable
from qmq.store.held import HELD_SEQUENCE, Held
from qmq.store.indexer import RecordIndexer
from qmq.store.intake import AppendResult, check_send
from qmq.store.message_log import MessageLog
from qmq.store.open_files import OpenFiles
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.recovery import RecoveryReport, StoreParts, empty_parts, recover
from qmq.store.redelivery import RedeliveryProblems
from qmq.store.segments import FlushTicket
from qmq.store.subjects import SubjectState
from qmq.store.tags import RecordFilter
from qmq.store.take import PullResult, Pulls

__all__ = ["AppendResult", "BrokerStore", "PullResult", "SubjectState"]

log = logging.getLogger(__name__)
T = TypeVar("T")

_CHECKPOINTS_KEPT = 4


class BrokerStore:
    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.dir = Path(config.data_dir)
        fileio.from_environment()  # a fault plan or an I/O trace (fileio.py), when the process has one
        fileio.make_dirs(self.dir)
        self._lock = DataDirLock(self.dir, "broker")
        # held for the life of the store: a checkpoint's syncfs goes through it (FlushTicket)
        self._dir_fd = fileio.open(self.dir, os.O_RDONLY)
        self.sync_policy = config.flush == "sync"
        # called after anything is written to the message log or the action log (slaves wait on it)
        self.on_grow: Callable[[], None] | None = None
        # why the store stopped taking writes (see the module docstring); None while it takes them
        self.failed: str | None = None
        self.scan_cut = False  # the last pull's group filter stopped its scan at its bounds (take.py)
        self.redelivery_problems = RedeliveryProblems()  # see redelivery.py
        self._open_files()
        self._install(empty_parts(self.dir, config, limits, self.alog, self.dead))

    def _open_files(self) -> None:
        self.mlog = MessageLog(self.dir / "log", self.config.segment_bytes)
        self.alog = ActionLog(self.dir / "action", on_append=self._grew)
        self.dead = DeadLetters(self.dir / "dead")
        self.flushed_offset = 0  # the message log is fsynced up to here
        # (message log, action log) ends the last flush ticket took: begin_flush
        self._ticketed = (-1, -1)

    def _install(self, parts: StoreParts) -> None:
        self._subjects = parts.subjects
        self._progress = parts.progress
        self.dedup = parts.dedup
        self.held = parts.held
        self._pulls = Pulls(
            self.mlog, parts.progress, self.limits.pull_bytes_max, self.config.ordered_lease_ms, parts.checked
        )

    def open(self) -> RecoveryReport:
        """Recover from whatever state the last stop left; see recovery.py."""
        parts, report = recover(self.dir, self.config, self.clock, self.limits, self.mlog, self.alog, self.dead)
        self._install(parts)
        self.flushed_offset = self.mlog.end
        return report

    # -- the parts, as callers outside the store use them ------------------------------

    @property
    def subjects(self) -> dict[str, SubjectState]:
        """Every subject by name (read only: a subject is created by its first message)."""
        return self._subjects.by_name

    @property
    def progress(self) -> Progress:
        return self._progress.progress

    @property
    def pulls(self) -> Pulls:
        """The reads for pulls, with what they found damaged (``entries_repaired``, ``damaged_records``)."""
        return self._pulls

    @property
    def consume_files(self) -> OpenFiles:
        """The consume logs' open files: how many (``len``), their bound, how many were closed to keep it."""
        return self._subjects.files

    @property
    def unflushed_bytes(self) -> int:
        """Bytes appended under the sync policy that wait for an fsync before pulls see them."""
        return self._subjects.unflushed_bytes

    def indexer(self, index_from: int) -> RecordIndexer:
        """An indexer of message-log records written without ``append`` (a slave's copy)."""
        return RecordIndexer(self._subjects, self.dedup, self.held, self.dead, index_from)

    # -- failures ----------------------------------------------------------------------

    def _refused(self) -> StoreError:
        return StoreError(
            f"the broker's store in {str(self.dir)!r} stopped taking writes ({self.failed}); it can no longer "
            "tell what is durable: restart the broker, and recovery will find what is on disk"
        )

    def _refused_before_writing(self) -> StoreFailedError:
        return StoreFailedError(str(self._refused()))

    def _write(self, what: str, write: Callable[..., T], *args: Any) -> T:
        """``write(*args)``, refused when the store failed; an OSError becomes the StoreError it is."""
        if self.failed is not None:
            raise self._refused_before_writing()
        try:
            return write(*args)
        except OSError as exc:
            raise self._write_failed(exc, what) from exc

    def _write_failed(self, exc: OSError, what: str) -> StoreError:
        """The error to raise for ``exc``, met while ``what``; the store fails unless it clears by itself.

        Retriable (StoreFailedError) when it does not: a send's batch was undone whole, and an
        action (an ack, a pull's record) repeats safely, so the request may go again, to the
        group's next master (a delay server gave up the due messages a failed append refused)."""
        err = store_error(exc, self.dir)
        if clears_by_itself(err):
            return err
        self._fail(f"{what} failed: {exc}")
        return self._refused_before_writing()

    def _fail(self, reason: str) -> None:
        if self.failed is None:
            self.failed = reason
            log.critical("the broker's store stops taking writes until a restart: %s", reason)

    def _flush_failed(self, exc: OSError) -> None:
        # may run on the flusher's thread: after a failed fsync the page cache's state is unknown
        self._fail(f"an fsync failed: {exc}")

    def replay_actions(self, start: int) -> tuple[int, int]:
        """Apply action-log records written without this store (a slave's copy); see ProgressLog.replay."""
        return self._progress.replay(start)

    # -- sends -------------------------------------------------------------------------

    def append(
        self,
        body: bytes,
        scanned: list[ScannedMessage],
        dedup_check: bool = True,
        now_ms: int | None = None,
        visible_now: bool = False,
        refused: Mapping[int, str] | None = None,
    ) -> AppendResult:
        """Store the messages of one send frame with one write; refuse the bad ones by index.

        Messages to a dead-letter subject go to the dead letters instead; messages due later
        than ``now_ms`` are held until due (held.py). ``dedup_check=False`` (the broker's own
        resends) stores a message even if its key is in the duplicate window. ``visible_now``
        (copies of held records, already durable) skips waiting for the fsync under the sync
        policy wherever nothing earlier of the subject still waits for one. ``refused`` names,
        by index, messages the caller found unfit to store (the reason goes into the errors).
        """
        if self.failed is not None:
            raise self._refused_before_writing()
        now = self.clock.now_ms() if now_ms is None else now_ms
        try:
            errors, accepted, duplicates, total = check_send(
                scanned, now, self.limits, self._subjects, self.dedup, dedup_check, refused
            )
            if not accepted:
                return AppendResult(errors, duplicates, 0, 0, {})
            base = self.mlog.offset_for_append(total)
        except OSError as exc:  # a new subject's consume log, or the message log's next segment
            raise self._write_failed(exc, "opening a file") from exc

        out = bytearray(total)
        view = memoryview(body)
        touched: dict[SubjectState, int] = {}
        per_subject: dict[str, list[int]] = {}
        dead_letters: dict[str, list[tuple[int, bytes | memoryview]]] = {}
        pos = 0
        pack_entry = ENTRY.pack
        held: list[Held] = []
        # The loop below packs the records of messages due now inline (what pack_record_into
        # does, less a call, a slice and a memoryview per message): it runs once per message sent.
        outv = memoryview(out)
        pack_head = RECORD_HEADER.pack_into
        pack_crc = RECORD_CRC.pack_into
        crc32 = crc32c.crc32c
        head_bytes = RECORD_HEADER_BYTES
        last: SubjectState | None = None
        counts = [0, 0]
        for sm, dest, bloom, key in accepted:
            start, length = sm.pos, sm.length
            if isinstance(dest, str):
                # a dead letter: in the message log (so slaves get it) and kept apart, never pulled
                message = view[start : start + length]
                dead_letters.setdefault(dest, []).append((base + pos, message))
                pos = pack_record_into(out, pos, message, 0, now)
                continue
            if sm.deliver_at_ms > now:
                # due later: written now, in no consume log until its copy is appended once due
                end = pack_record_into(out, pos, view[start : start + length], HELD_SEQUENCE, now)
                held.append(Held(sm.deliver_at_ms, base + pos, end - pos, key))
                pos = end
                continue
            st = dest
            if st is not last:
                last = st
                if st not in touched:
                    touched[st] = st.next_seq
                counts = per_subject.setdefault(st.name, [0, 0])
            seq = st.next_seq
            st.next_seq = seq + 1
            at = pos + head_bytes
            end = at + length
            outv[at:end] = view[start : start + length]
            pack_head(out, pos, RECORD_MAGIC, 0, length, seq, now)
            pack_crc(out, pos + 4, crc32(outv[pos + 8 : end]))
            # the message's order slot + 1 (0 without an order key) goes into the entry's last field
            slot = order_slot_field(body, start) if body[start + FLAGS_POS] & FLAG_ORDERED else 0
            st.pending += pack_entry(base + pos, end - pos, now, bloom, slot)
            pos = end
            counts[0] += 1
            counts[1] += length
        self._write_batch(out, base, touched, dead_letters, now)
        self.dedup.add_many([a[3] for a in accepted], now)
        self.dedup.total_messages += len(accepted)
        for h in held:
            self.held.add(h)
        self._subjects.publish(touched, self.mlog.end, total, self.sync_policy, visible_now)
        self._grew()
        return AppendResult(errors, duplicates, len(accepted), total, per_subject)

    def _write_batch(
        self,
        out: bytearray,
        base: int,
        touched: dict[SubjectState, int],
        dead_letters: dict[str, list[tuple[int, bytes | memoryview]]],
        now_ms: int,
    ) -> None:
        """Write one send's records (``out``, at ``base``), its consume-log entries (each touched
        subject's ``pending``, from the sequence ``touched`` gives) and its dead letters: all of
        them, or none (see the module docstring)."""
        clogs_written: list[SubjectState] = []
        dead_marks: dict[str, tuple[int, int, int] | None] = {}
        what = "the message-log append"
        try:
            self.mlog.append(out)
            what = "a consume-log append"
            for st in touched:
                st.clog.append(st.pending)
                clogs_written.append(st)
            what = "a dead-letter append"
            for name, letters in dead_letters.items():
                dead_marks[name] = self.dead.mark(name)
                self.dead.append(name, letters, now_ms)
        except OSError as exc:
            for st, first in touched.items():
                st.next_seq = first
                st.pending.clear()
            try:
                for st in clogs_written:
                    st.clog.truncate(touched[st])
                for name, mark in dead_marks.items():
                    self.dead.cut_back(name, mark)
                if self.mlog.end > base:
                    self.mlog.truncate(base)
            except OSError as undo:
                self._fail(f"{what} failed ({exc}) and the batch could not be undone: {undo}")
                raise self._refused() from exc
            raise self._write_failed(exc, what) from exc
        for st in touched:
            st.pending.clear()

    # -- flush -------------------------------------------------------------------------

    def begin_flush(self, consume_logs: bool = False) -> FlushTicket:
        """fsync work for what was written so far: the message log, dead letters and the action
        log (the ticket's ``action_offset``); with ``consume_logs``
        (checkpoints) also, with one syncfs of the data's file system, every consume log written
        since the last one (open or closed: open_files.py).

        Acks, pulls and resets reach the OS at once, so ``kill -9`` loses none; an ack is answered
        only after the flush that covers it (under flush = "sync"; under "periodic" that flush
        comes within ``flush_interval_ms``), so a power loss does not deliver again what a group
        was told it had acknowledged. The broker's one group commit covers both logs: sends, acks
        and pulls share its fsyncs. Only that group commit calls this (a checkpoint on its own
        thread: ``begin_checkpoint_flush``): the segments rolled since the last flush are handed
        to one ticket only, and an answer must never go out before the thread holding them has
        fsynced them.
        """
        # a log with nothing written since the last ticket needs no fsync: that ticket covers it,
        # and finishes first (tickets run in order: serving/group_commit.py)
        fds = [] if self.mlog.end == self._ticketed[0] else self.mlog.segments.sync_fds()
        fds.extend(self.dead.take_sync_fds())  # dead letters are answered like any send: after this flush
        action_offset = self.alog.end
        action_fds = [] if action_offset == self._ticketed[1] else self.alog.segments.sync_fds()
        self._ticketed = (self.mlog.end, action_offset)
        syncfs_fd = -1
        if consume_logs:
            files = self._subjects.files
            if files.unsynced:
                files.unsynced = False
                syncfs_fd = self._dir_fd
        return FlushTicket(fds, self.mlog.end, self._flush_failed, syncfs_fd, action_offset, action_fds)

    def begin_checkpoint_flush(self) -> FlushTicket:
        """fsync work for a checkpoint taken on its own thread, after a flush of the group commit
        that covers the offsets it names: one syncfs of the data's file system, for every consume
        log written since the last one (open or closed: open_files.py), if any was. The logs are
        left to the group commit: the segments a ticket takes are fsynced by that ticket alone,
        and answers go out only once the group commit's tickets, in order, are done."""
        files = self._subjects.files
        syncfs_fd = -1
        if files.unsynced:
            files.unsynced = False
            syncfs_fd = self._dir_fd
        return FlushTicket([], self.mlog.end, self._flush_failed, syncfs_fd)

    def complete_flush(self, ticket: FlushTicket) -> set[str]:
        """Make everything the ticket covered visible; returns the subjects that moved."""
        self.flushed_offset = max(self.flushed_offset, ticket.offset)
        return self._subjects.flushed(ticket.offset, self.mlog.end - self.flushed_offset)

    # -- pulls and acks ----------------------------------------------------------------

    def group(self, subject: str, group: str, start: str) -> GroupProgress:
        gp = self.progress.get(subject, group)
        if gp is None:
            st = self._subjects.get(subject)
            if start == "earliest":
                start_seq = st.clog.min_seq if st else 0
            else:
                start_seq = st.visible_seq if st else 0
            gp = self._write("an action-log append", self._progress.create_group, subject, group, start_seq)
        return gp

    def new_stretch(self) -> None:
        """A slave promoted: pull logs go on above every position its old master may have handed
        out, those it never replicated too (progress.py)."""
        self._progress.new_stretch()

    def ack(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> int:
        return self._write("an action-log append", self._progress.ack, gp, cp, ranges)

    def reset(self, gp: GroupProgress, to: str | int) -> int:
        """Move a group's pull offset to ``"earliest"``, ``"latest"`` or the first message stored at or
        after a time (epoch ms); its consumers pull from there next. Returns the new offset."""
        st = self._subjects.get(gp.subject)
        if st is None:
            seq = 0
        elif to == "earliest":
            seq = st.clog.min_seq
        elif to == "latest":
            seq = st.visible_seq
        else:
            seq = min(st.clog.seq_at_time(int(to)), st.visible_seq)
        self._write("an action-log append", self._progress.reset, gp, seq)
        return seq

    def forget_gone_consumers(self, now_ms: int, gone_ms: int) -> int:
        """Forget consumers silent for ``gone_ms`` with nothing unacknowledged (ProgressLog.forget_gone)."""
        return self._progress.forget_gone(now_ms, gone_ms)

    def remove_dead(self, dead_subject: str, numbers: list[int]) -> None:
        """Drop dead letters (resent or purged), logged so replay and slaves drop them too."""
        self._write("removing dead letters", self._progress.remove_dead, dead_subject, numbers)

    def shared_reads(self) -> contextlib.AbstractContextManager[None]:
        """Within: groups pulling the same next messages share one read of them (take.Pulls.shared_reads)."""
        return self._pulls.shared_reads()

    def pull(
        self,
        gp: GroupProgress,
        cp: ConsumerProgress,
        session: str,
        max_n: int,
        tag_filter: RecordFilter | None = None,
        bytes_max: int | None = None,
    ) -> PullResult | None:
        """Hand ``cp`` up to ``max_n`` messages (see take.Pulls.pull); a pull is logged, so a write."""
        st = self._subjects.get(gp.subject)
        now_ms = self.clock.now_ms()
        self.scan_cut = False
        if not isinstance(tag_filter, GroupFilter):
            return self._write("a pull", self._pulls.pull, st, gp, cp, session, max_n, tag_filter, now_ms, bytes_max)
        tag_filter.begin_scan()
        try:
            result = self._write("a pull", self._pulls.pull, st, gp, cp, session, max_n, tag_filter, now_ms, bytes_max)
        except BaseException:
            del tag_filter.waiting[:]  # nothing was passed over: the next pull meets them again
            raise
        # a scan the filter's bounds stopped: the rest is for a pull right after, not a long wait
        self.scan_cut = tag_filter.full()
        # in the same call as the pull that passed them over (a long poll's too): none waits in
        # memory for a later pull, so a broker that stops after this pull loses none
        dead_letter_unevaluable(self, gp.subject, gp.group, tag_filter)
        return result

    @property
    def dispatched(self) -> bool:
        """Whether the last pull of an ordered group handed messages to consumers other than the
        puller (their long polls may be answered now)."""
        return self._pulls.ordered.dispatched

    @property
    def settling_ms(self) -> int:
        """How much longer the ordered group of the last pull places no slots (0: it does)."""
        return self._pulls.ordered.settling_ms

    def leave_ordered(self, gp: GroupProgress, cp: ConsumerProgress) -> None:
        """``cp`` closed: the slots it owns of its ordered group go to the group's other consumers
        at their next pull, rather than when its lease runs out (``ordered_take``)."""
        self._pulls.ordered.leave(self._subjects.get(gp.subject), gp, cp, self.clock.now_ms())

    def read_range(self, subject: str, from_seq: int, max_n: int) -> tuple[int, int, list[bytes]]:
        """Records of ``subject`` by sequence, outside any consumer group (see take.Pulls.read_range)."""
        return self._pulls.read_range(self._subjects.get(subject), from_seq, max_n)

    # -- checkpoints -------------------------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        now = self.clock.now_ms()
        return {
            "version": CHECKPOINT_VERSION,
            "time_ms": now,
            "message_offset": self.mlog.end,
            "action_offset": self.alog.end,
            "total_messages": self.dedup.total_messages,
            "marks": self.dedup.mark(now, self.mlog.end),
            "subjects": {st.name: st.next_seq for st in self._subjects},
            "held": self.held.snapshot(),
            "progress": self.progress.snapshot(),
            # groups pulled with ``ordered`` (a key older versions ignore): see store/ordered_take.py
            "ordered_groups": [[gp.subject, gp.group] for gp in self.progress.groups.values() if gp.ordered],
        }

    def write_checkpoint(self, ticket: FlushTicket, state: dict[str, Any]) -> None:
        """Thread-safe part of a checkpoint: fsync what it covers, then replace the checkpoint file
        (keeping the last few, for a demoted master cutting its logs back; see replica.rewind).

        A failed store writes none: it can no longer vouch for the offsets it would name."""
        if self.failed is not None:
            raise self._refused()
        try:
            ticket.run()  # a failed fsync fails the store (the ticket's on_error)
        except OSError as exc:
            raise self._refused() from exc
        # keyed by both offsets: checkpoints of acks alone (no new messages) are kept apart too
        key = (state["message_offset"], state["action_offset"])
        try:
            write_checkpoint(self.dir, state, history_key=key, history_max=_CHECKPOINTS_KEPT)
        except OSError as exc:
            raise self._write_failed(exc, "writing the checkpoint") from exc

    def after_checkpoint(self, state: dict[str, Any]) -> None:
        # action-log segments are kept back to the oldest kept checkpoint that checks out, which
        # recovery falls back to when the newer ones are damaged
        oldest = state["action_offset"]
        for path in checkpoint_history(self.dir):
            kept = read_checkpoint(self.dir, path)
            if kept is not None:
                oldest = min(oldest, kept["action_offset"])
                break
        self.alog.delete_before(oldest)

    def _grew(self) -> None:
        if self.on_grow is not None:
            self.on_grow()

    def close_files(self) -> None:
        """Close every log, keeping the directory's lock (see replica.rewind)."""
        self.mlog.close()
        self.alog.close()
        self.dead.close()
        self._subjects.close()

    def reopen(self) -> RecoveryReport:
        self._open_files()
        return self.open()

    def close(self) -> None:
        self.close_files()
        if self._dir_fd >= 0:
            fileio.close(self._dir_fd)
            self._dir_fd = -1
        self._lock.release()
