"""The broker's store: what a send appends, what a pull reads, what an ack records.

Directory layout under ``data_dir``::

    LOCK                      held (flock) by the one broker using this directory
    checkpoint                offsets, subjects and consumer progress (see checkpoint.py)
    log/<base>.log            message log segments (message_log.py)
    consume/<subject>/        one consume log per subject (consume_log.py); <subject> escaped
    action/<base>.act         action log segments (action_log.py)

Everything is synchronous. ``begin_flush`` returns a ticket whose ``run`` (fdatasync of the
files written since the last flush) may run on another thread; ``complete_flush`` then makes
the flushed messages visible to consumers. Recovery lives in ``recovery.py``.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import BrokerConfig
from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS, HOLD_MS_MAX, Limits
from qmq.common.naming import DEAD_PREFIX, check_subject, parse_internal_subject, subject_file_name
from qmq.protocol.codes import Status
from qmq.protocol.message import ScannedMessage
from qmq.protocol.record import RECORD_HEADER_BYTES, pack_record_into
from qmq.store import action_log as act
from qmq.store.action_log import ActionLog
from qmq.store.checkpoint import history as checkpoint_history
from qmq.store.checkpoint import read_checkpoint, write_checkpoint
from qmq.store.consume_log import ENTRY, ConsumeLog, tag_bloom
from qmq.store.datadir import DataDirLock, StoreError, store_error
from qmq.store.dead_letters import DeadLetters
from qmq.store.dedup import DedupWindow
from qmq.store.held import HELD_SEQUENCE, Held, HeldMessages
from qmq.store.message_log import MessageLog
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.segments import FlushTicket
from qmq.store.tags import TagFilter
from qmq.store.take import read_range, take_matching, take_next

if TYPE_CHECKING:
    from qmq.store.recovery import RecoveryReport

log = logging.getLogger(__name__)

_MARKS_MAX = 1000
_CHECKPOINTS_KEPT = 4
_DEAD_RAW = DEAD_PREFIX.encode()
_DEAD_NAMES_CACHED_MAX = 10_000



@dataclass(slots=True, eq=False)
class SubjectState:
    name: str
    clog: ConsumeLog
    next_seq: int
    visible_seq: int
    pending: bytearray = field(default_factory=bytearray)


class AppendResult(NamedTuple):
    errors: list[list[Any]]  # [index, status, text]
    duplicates: int
    stored: int
    stored_bytes: int
    per_subject: dict[str, list[int]]  # subject -> [messages, bytes]


class PullResult(NamedTuple):
    runs: list[list[int]]  # [pull_offset, count]
    chunks: list[bytes]  # stored records, back to back
    messages: int
    nbytes: int


class BrokerStore:
    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.dir = Path(config.data_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self._lock = DataDirLock(self.dir, "broker")
        self.sync_policy = config.flush == "sync"
        # called after anything is written to the message log or the action log (slaves wait on it)
        self.on_grow: Callable[[], None] | None = None
        self._init_state()

    def _init_state(self) -> None:
        """Open the logs and start from empty in-memory state (``open`` then recovers into it)."""
        config = self.config
        self.mlog = MessageLog(self.dir / "log", config.segment_bytes)
        self.alog = ActionLog(self.dir / "action", on_append=self._grew)
        self.consume_dir = self.dir / "consume"
        self.consume_dir.mkdir(exist_ok=True)
        self.subjects: dict[str, SubjectState] = {}
        self._by_raw: dict[bytes, SubjectState] = {}
        self.progress = Progress()
        self.dead = DeadLetters(self.dir / "dead")
        self._dead_names: dict[bytes, str] = {}
        self.dedup = DedupWindow(config.dedup_window_ms, config.dedup_entries_max)
        self.total_messages = 0
        self.marks: list[list[int]] = []  # [now_ms, message-log offset, total_messages], for the dedup rebuild
        # sync policy: appended batches waiting for fsync: (end_offset, [(subject state, next_seq)])
        self._unflushed: deque[tuple[int, list[tuple[SubjectState, int]]]] = deque()
        self._dirty_clogs: set[SubjectState] = set()
        self.unflushed_bytes = 0
        self.flushed_offset = 0  # the message log is fsynced up to here
        self.held = HeldMessages()

    def open(self) -> RecoveryReport:
        """Recover from whatever state the last stop left; see recovery.py."""
        from qmq.store.recovery import recover

        report = recover(self)
        self.flushed_offset = self.mlog.end
        return report

    # -- subjects ----------------------------------------------------------------------

    def subject_state(self, name: str, create: bool = True) -> SubjectState | None:
        st = self.subjects.get(name)
        if st is None and create:
            clog = ConsumeLog(self.consume_dir / subject_file_name(name), name, self.config.consume_log_segment_entries)
            st = SubjectState(name, clog, clog.next_seq, clog.next_seq)
            self.subjects[name] = st
            self._by_raw[name.encode("utf-8")] = st
        return st

    def _dead_name(self, raw: bytes) -> str:
        name = self._dead_names.get(raw)
        if name is None:
            try:
                name = raw.decode("utf-8")
            except UnicodeDecodeError:
                raise InvalidSubjectError(f"subject {raw[:60]!r} is not valid UTF-8") from None
            parse_internal_subject(name, self.limits)
            if len(self._dead_names) < _DEAD_NAMES_CACHED_MAX:
                self._dead_names[raw] = name
        return name

    def _subject_for_raw(self, raw: bytes) -> SubjectState:
        st = self._by_raw.get(raw)
        if st is not None:
            return st
        try:
            name = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise InvalidSubjectError(f"subject {raw[:60]!r} is not valid UTF-8") from None
        check_subject(name, self.limits)
        st = self.subject_state(name)
        assert st is not None
        return st

    # -- sends -------------------------------------------------------------------------

    def append(
        self,
        body: bytes,
        scanned: list[ScannedMessage],
        dedup_check: bool = True,
        now_ms: int | None = None,
        visible_now: bool = False,
    ) -> AppendResult:
        """Store the messages of one send frame with one write; refuse the bad ones by index.

        Messages to a dead-letter subject go to the dead letters instead; messages due later
        than ``now_ms`` are held until due (held.py). ``dedup_check=False`` (the broker's own
        resends) stores a message even if its key is in the duplicate window. ``visible_now``
        (copies of held records, already durable) skips waiting for the fsync under the sync
        policy wherever nothing earlier of the subject still waits for one.
        """
        now = self.clock.now_ms() if now_ms is None else now_ms
        limits = self.limits
        errors: list[list[Any]] = []
        # (message, its subject state or the name of its dead-letter subject, tag bloom, dedup key)
        accepted: list[tuple[ScannedMessage, SubjectState | str, int, int]] = []
        seen: set[int] = set()
        dedup = self.dedup
        duplicates = 0
        total = 0
        for i, sm in enumerate(scanned):
            dead_name = None
            st: SubjectState | None = None
            try:
                if sm.subject.startswith(_DEAD_RAW):
                    dead_name = self._dead_name(sm.subject)
                else:
                    st = self._subject_for_raw(sm.subject)
            except InvalidSubjectError as exc:
                errors.append([i, Status.INVALID_SUBJECT, str(exc)])
                continue
            if sm.length > limits.message_bytes_max:
                errors.append(
                    [
                        i,
                        Status.MESSAGE_TOO_LARGE,
                        f"message of {sm.length} bytes exceeds message_bytes_max {limits.message_bytes_max}",
                    ]
                )
                continue
            if not sm.message_id or len(sm.message_id) > limits.message_id_chars_max:
                errors.append([i, Status.INVALID_MESSAGE, f"message id must be 1..{limits.message_id_chars_max} bytes"])
                continue
            if sm.deliver_at_ms > now + HOLD_MS_MAX:
                errors.append(
                    [
                        i,
                        Status.INVALID_MESSAGE,
                        f"due {sm.deliver_at_ms - now} ms from now: a broker holds messages due at most "
                        f"{HOLD_MS_MAX} ms ahead; send later ones to a delay server",
                    ]
                )
                continue
            bloom = 0
            if sm.tags:
                if _tag_count(sm.tags) > limits.tags_max:
                    errors.append([i, Status.INVALID_MESSAGE, f"message has more than tags_max {limits.tags_max} tags"])
                    continue
                bloom = tag_bloom(sm.tags)
            key = dedup_key(sm)
            if key in seen or (dedup_check and key in dedup):
                duplicates += 1
                continue
            seen.add(key)
            target: SubjectState | str
            if st is not None:
                target = st
            else:
                assert dead_name is not None
                target = dead_name
            accepted.append((sm, target, bloom, key))
            total += RECORD_HEADER_BYTES + sm.length
        if not accepted:
            return AppendResult(errors, duplicates, 0, 0, {})

        base = self.mlog.offset_for_append(total)
        out = bytearray(total)
        view = memoryview(body)
        touched: dict[SubjectState, int] = {}
        per_subject: dict[str, list[int]] = {}
        dead_letters: dict[str, list[tuple[int, bytes | memoryview]]] = {}
        pos = 0
        pack_entry = ENTRY.pack
        held: list[Held] = []
        for sm, dest, bloom, key in accepted:
            message = view[sm.pos : sm.pos + sm.length]
            if isinstance(dest, str):
                # a dead letter: in the message log (so slaves get it) and kept apart, never pulled
                dead_letters.setdefault(dest, []).append((base + pos, message))
                pos = pack_record_into(out, pos, message, 0, now)
                continue
            if sm.deliver_at_ms > now:
                # due later: written now, in no consume log until its copy is appended once due
                end = pack_record_into(out, pos, message, HELD_SEQUENCE, now)
                held.append(Held(sm.deliver_at_ms, base + pos, end - pos, key))
                pos = end
                continue
            st = dest
            if st not in touched:
                touched[st] = st.next_seq
            seq = st.next_seq
            st.next_seq = seq + 1
            end = pack_record_into(out, pos, message, seq, now)
            st.pending += pack_entry(base + pos, end - pos, now, bloom, 0)
            pos = end
            counts = per_subject.get(st.name)
            if counts is None:
                per_subject[st.name] = [1, sm.length]
            else:
                counts[0] += 1
                counts[1] += sm.length
        try:
            self.mlog.append(out)
        except OSError as exc:
            for st, seq in touched.items():
                st.next_seq = seq
                st.pending.clear()
            raise store_error(exc, self.dir) from exc
        for st in touched:
            try:
                st.clog.append(st.pending)
            except OSError as exc:
                # The message log holds the records; recovery rebuilds this consume log from it.
                raise StoreError(f"consume log of {st.name!r} could not be written: {exc}") from exc
            finally:
                st.pending.clear()
            self._dirty_clogs.add(st)
        for name, letters in dead_letters.items():
            try:
                self.dead.append(name, letters, now)
            except OSError as exc:
                raise store_error(exc, self.dir) from exc
        dedup.add_many([a[3] for a in accepted], now)
        self.total_messages += len(accepted)
        for h in held:
            self.held.add(h)
        if not self.sync_policy:
            for st in touched:
                st.visible_seq = st.next_seq
        elif not visible_now:
            self._unflushed.append((self.mlog.end, [(st, st.next_seq) for st in touched]))
            self.unflushed_bytes += total
        else:
            waiting = []
            for st, first in touched.items():
                if st.visible_seq == first:
                    st.visible_seq = st.next_seq
                else:  # an earlier message of the subject waits for its fsync: this one waits behind it
                    waiting.append((st, st.next_seq))
            if waiting:
                self._unflushed.append((self.mlog.end, waiting))
                self.unflushed_bytes += total
        self._grew()
        return AppendResult(errors, duplicates, len(accepted), total, per_subject)

    # -- flush -------------------------------------------------------------------------

    def begin_flush(self, consume_logs: bool = False) -> FlushTicket:
        """fsync work for what was written so far: the message log always; with ``consume_logs``
        (checkpoints) also the action log and every consume log written since the last one.

        Acks and pulls reach the OS at once, so ``kill -9`` loses none; fsyncing them only at
        checkpoints keeps the send path to one fsync per group commit. A power loss may then
        re-deliver what was acknowledged since the last checkpoint: at least once, never lost.
        """
        fds = self.mlog.segments.sync_fds()
        if consume_logs:
            fds.extend(self.alog.segments.sync_fds())
            for st in self._dirty_clogs:
                fds.extend(st.clog.segments.sync_fds())
            self._dirty_clogs.clear()
        return FlushTicket(fds, self.mlog.end)

    def complete_flush(self, ticket: FlushTicket) -> set[str]:
        """Make everything the ticket covered visible; returns the subjects that moved."""
        moved: set[str] = set()
        self.flushed_offset = max(self.flushed_offset, ticket.offset)
        unflushed = self._unflushed
        while unflushed and unflushed[0][0] <= ticket.offset:
            _end, seqs = unflushed.popleft()
            for st, seq in seqs:
                if seq > st.visible_seq:
                    st.visible_seq = seq
                    moved.add(st.name)
        self.unflushed_bytes = self.mlog.end - self.flushed_offset if unflushed else 0
        return moved

    # -- pulls and acks ----------------------------------------------------------------

    def group(self, subject: str, group: str, start: str) -> GroupProgress:
        gp = self.progress.get(subject, group)
        if gp is None:
            st = self.subjects.get(subject)
            if start == "earliest":
                start_seq = st.clog.min_seq if st else 0
            else:
                start_seq = st.visible_seq if st else 0
            self.alog.append([act.CREATE_GROUP, subject, group, start_seq])
            gp = self.progress.create_group(subject, group, start_seq)
        return gp

    def ack(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> int:
        self.alog.append([act.ACK, gp.subject, gp.group, cp.consumer_id, ranges])
        return Progress.apply_ack(cp, ranges)

    def reset(self, gp: GroupProgress, to: str | int) -> int:
        """Move a group's pull offset to ``"earliest"``, ``"latest"`` or the first message stored at or
        after a time (epoch ms); its consumers pull from there next. Returns the new offset."""
        st = self.subjects.get(gp.subject)
        if st is None:
            seq = 0
        elif to == "earliest":
            seq = st.clog.min_seq
        elif to == "latest":
            seq = st.visible_seq
        else:
            seq = min(st.clog.seq_at_time(int(to)), st.visible_seq)
        self.alog.append([act.RESET, gp.subject, gp.group, seq])
        gp.pull_offset = seq
        return seq

    def remove_dead(self, dead_subject: str, numbers: list[int]) -> None:
        """Drop dead letters (resent or purged), logged so replay and slaves drop them too."""
        if numbers:
            self.alog.append([act.DEAD_REMOVE, dead_subject, numbers])
            self.dead.remove(dead_subject, numbers)

    def ack_locally(self, cp: ConsumerProgress, ranges: list[list[int]]) -> None:
        """An ack the broker makes itself; replay reaches the same state by the same rule."""
        Progress.apply_ack(cp, ranges)

    def pull(
        self,
        gp: GroupProgress,
        cp: ConsumerProgress,
        session: str,
        max_n: int,
        tag_filter: TagFilter | None = None,
    ) -> PullResult | None:
        """Hand ``cp`` up to ``max_n`` messages: first what it pulled before and never acked
        (when its session changed), then the group's next visible messages (those matching
        ``tag_filter``, when the group subscribes with tags)."""
        if cp.session != session:
            cp.session = session
            cp.cursor = cp.ack_offset
        st = self.subjects.get(gp.subject)
        if st is None:
            return None
        out = PullResult([], [], 0, 0)
        for poff, seq, k in Progress.take_redelivery(cp, max_n):
            got, size = self.read_records(st.clog.read(seq, k), out.chunks, cp, poff, out.runs)
            out = out._replace(messages=out.messages + got, nbytes=out.nbytes + size)
        left = max_n - out.messages
        budget = self.limits.pull_bytes_max - out.nbytes
        if left > 0 and budget > 0:
            if tag_filter is None:
                out = take_next(self, gp, cp, st, left, budget, out)
            else:
                out = take_matching(self, gp, cp, st, left, budget, tag_filter, out)
        return out if out.messages else None

    def read_range(self, subject: str, from_seq: int, max_n: int) -> tuple[int, int, list[bytes]]:
        """Records of ``subject`` by sequence, outside any consumer group (see take.read_range)."""
        return read_range(self, subject, from_seq, max_n)

    def record_pull(self, gp: GroupProgress, cp: ConsumerProgress, runs: list[list[int]], new_offset: int) -> int:
        """Log and apply a pull of consume-log ``runs``; returns the pull-log offset of its first entry."""
        self.alog.append([act.PULL, gp.subject, gp.group, cp.consumer_id, cp.pull_log_end, runs, new_offset])
        return Progress.record_pull(gp, cp, runs, new_offset)

    def read_records(
        self, entries: bytes, chunks: list[bytes], cp: ConsumerProgress, poff: int, runs: list[list[int]]
    ) -> tuple[int, int]:
        """Append the records of ``entries`` (pull-log offsets from ``poff``) to ``chunks`` and
        their offsets to ``runs``, coalescing adjacent records into one read."""
        log_start = self.mlog.start
        run_off = -1
        run_end = -1
        got = 0
        nbytes = 0
        for i, (off, size, _ms, _bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
            if off < log_start:
                # removed by retention while pulled and unacked: nothing to send, so it is done
                self.ack_locally(cp, [[poff + i, poff + i + 1]])
                continue
            if runs and runs[-1][0] + runs[-1][1] == poff + i:
                runs[-1][1] += 1
            else:
                runs.append([poff + i, 1])
            if off == run_end:
                run_end += size
            else:
                if run_end > run_off >= 0:
                    self.read_into(run_off, run_end - run_off, chunks)
                run_off, run_end = off, off + size
            got += 1
            nbytes += size
        if run_end > run_off >= 0:
            self.read_into(run_off, run_end - run_off, chunks)
        return got, nbytes

    def read_into(self, offset: int, size: int, chunks: list[bytes]) -> None:
        while size > 0:
            data = self.mlog.read(offset, size)
            if not data:
                raise StoreError(f"message log has no data at offset {offset} ({size} bytes expected)")
            chunks.append(data)
            offset += len(data)
            size -= len(data)

    # -- checkpoints and retention -----------------------------------------------------

    def checkpoint_state(self) -> dict[str, Any]:
        now = self.clock.now_ms()
        self.marks.append([now, self.mlog.end, self.total_messages])
        window_start = now - self.config.dedup_window_ms
        while len(self.marks) > 1 and (self.marks[1][0] <= window_start or len(self.marks) > _MARKS_MAX):
            self.marks.pop(0)
        return {
            "version": 1,
            "time_ms": now,
            "message_offset": self.mlog.end,
            "action_offset": self.alog.end,
            "total_messages": self.total_messages,
            "marks": self.marks,
            "subjects": {name: st.next_seq for name, st in self.subjects.items()},
            "held": self.held.snapshot(),
            "progress": self.progress.snapshot(),
        }

    def write_checkpoint(self, ticket: FlushTicket, state: dict[str, Any]) -> None:
        """Thread-safe part of a checkpoint: fsync what it covers, then replace the checkpoint file
        (keeping the last few, for a demoted master cutting its logs back; see replica.rewind)."""
        ticket.run()
        write_checkpoint(self.dir, state, history_key=state["message_offset"], history_max=_CHECKPOINTS_KEPT)

    def after_checkpoint(self, state: dict[str, Any]) -> None:
        # action-log segments are kept back to the oldest kept checkpoint, which may be recovered from
        oldest = state["action_offset"]
        for path in checkpoint_history(self.dir)[:1]:
            kept = read_checkpoint(self.dir, path)
            if kept is not None:
                oldest = min(oldest, kept["action_offset"])
        self.alog.delete_before(oldest)

    def _grew(self) -> None:
        if self.on_grow is not None:
            self.on_grow()

    def close_files(self) -> None:
        """Close every log, keeping the directory's lock (see replica.rewind)."""
        self.mlog.close()
        self.alog.close()
        self.dead.close()
        for st in self.subjects.values():
            st.clog.close()
        self.subjects = {}
        self._by_raw = {}

    def reopen(self) -> RecoveryReport:
        self._init_state()
        return self.open()

    def close(self) -> None:
        self.close_files()
        self._lock.release()


def dedup_key(sm: ScannedMessage) -> int:
    """What makes two sends the same message: its id, on the same subject, at the same attempt.

    A retry re-sends a message with its id to a retry subject and a higher attempt count; a
    producer's retry or a delay server's repeated hand-over repeats all three.
    """
    return hash((sm.message_id, sm.subject, sm.times))


def _tag_count(tags_block: bytes) -> int:
    n = 0
    pos = 0
    while pos < len(tags_block):
        pos += 1 + tags_block[pos]
        n += 1
    return n

