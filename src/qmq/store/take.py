"""Pulls: what a consumer receives from a subject and how the store reads it.

A pull hands a consumer first what it pulled before and never acked (when its session
changed), then the group's next messages: the range after the group's pull offset, or, for a
group subscribed with tags, the matching messages in it.

A pull takes every message written, also those whose fsync is still to come under flush =
"sync" (``next_seq``, not ``visible_seq``): its answer waits for the group commit's next
flush, which covers both its record in the action log and the messages it hands out (the
broker's handlers), so a consumer still only ever has durable messages, and a message
waits for one fsync between its send and its delivery, not two. A power loss before that
flush may keep the pull's record and lose the messages (the kernel writes pages back in any
order): recovery then cuts the pull logs back to the subjects' ends (``recovery.py``).

``read_range`` reads a subject by sequence outside any group (READ, for data jobs): only
what is durable (``visible_seq``), since its answer waits for nothing.

Entries whose records retention removed are skipped (never handed out). A filtered take
scans at most ``_SCAN_ENTRIES_MAX`` entries per pull, so a subject full of other tags costs
bounded work; the group's pull offset moves past what was scanned either way.

A pull reads everything it hands out before it records the pull in the action log, so a read
that fails (a failing disk) changes nothing: that pull is answered with ``PullReadError`` and
the consumer pulls the same messages again; the store goes on.

Every record read is checked against the consume-log entry that named it (clog_repair.py;
with numpy for a pull of many), and its CRC below what recovery read (``Checked``): an entry
that disagrees (damaged) makes the pull rewrite its subject's disagreeing entries from the
message log, from the first of them on, and start again (a few times at most); a record that
fails its CRC, that recovery found damaged, or whose entry still disagrees after a repair, is
never handed out: the group's offset moves past it, and a consumer that pulled it before the
damage is done with it, as with a record retention removed. Both are logged and counted
(``entries_repaired``, ``damaged_records``).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from typing import NamedTuple, TypeVar

import crc32c
import numpy as np

from qmq.protocol.record import RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store import clog_repair
from qmq.store.action_log import ProgressLog
from qmq.store.clog_repair import DAMAGED, GOOD, check_record
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, ENTRY_DTYPE
from qmq.store.datadir import StoreError
from qmq.store.message_log import Checked, MessageLog
from qmq.store.ordered_take import OrderedDispatch
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.record_read import FAST_ENTRIES_MIN, kept_within, read_fast, without
from qmq.store.subjects import SubjectState
from qmq.store.tags import RecordFilter

log = logging.getLogger(__name__)
_T = TypeVar("_T")

_SCAN_ENTRIES_MAX = 20_000
_SCAN_CHUNK_ENTRIES = 2048
_REPAIRS_MAX = 4  # repairs of a subject's consume log one pull may make
_UNREPAIRABLE_MAX = 10_000  # (subject, sequence) of damaged records remembered, so a repair is tried once


class PullResult(NamedTuple):
    runs: list[list[int]]  # [pull_offset, count]
    chunks: list[bytes]  # stored records, back to back
    messages: int
    nbytes: int


class _Read(NamedTuple):
    """A group's next messages as read and checked (``Pulls.reads``): the leading entries
    retention removed, the records kept, their chunks, runs from pull offset 0, messages, bytes."""

    skip: int
    k: int
    chunks: tuple[bytes, ...]
    runs: tuple[tuple[int, int], ...]
    got: int
    nbytes: int


class PullReadError(StoreError):
    """Reading what a pull would hand out failed; nothing of the pull was recorded."""


class _Disagrees(Exception):
    """An entry of ``subject`` from sequence ``seq`` disagrees with its record: repair and pull again."""

    def __init__(self, seq: int) -> None:
        super().__init__(seq)
        self.seq = seq


class Pulls:
    """Reads for pulls: records from the message log by a subject's consume-log entries, each
    pull logged and applied through ``progress``; at most ``bytes_max`` bytes of records a pull."""

    def __init__(
        self,
        mlog: MessageLog,
        progress: ProgressLog,
        bytes_max: int,
        ordered_lease_ms: int,
        checked: Checked | None = None,
    ) -> None:
        self.mlog = mlog
        # records recovery checked need no CRC check again, unless in bytes it found damaged
        self.checked = Checked() if checked is None else checked
        self.progress = progress
        self.bytes_max = bytes_max
        self._bytes_max = bytes_max  # of the pull being made
        self.ordered = OrderedDispatch(mlog, progress, ordered_lease_ms)
        self._recorded = False  # the pull being made wrote the action log (see ``pull``)
        self.entries_repaired = 0  # consume-log entries rewritten from the message log
        self.damaged_records = 0  # records that failed their check when read: never handed out
        # records known damaged (an entry still disagreeing after a repair, or a failed CRC)
        self._damaged: dict[tuple[str, int], None] = {}
        self._repairing = False  # the pull being made follows a repair: disagreeing entries are damage
        # while on (``shared_reads``): the records read for a group's next messages, by subject,
        # first sequence, count and log start, for another group pulling the same ones in the
        # same request (a fan-out's PULL_MANY: 70 groups, the same records) to take unread
        self.reads: dict[tuple[str, int, int, int], _Read] | None = None

    def pull(
        self,
        st: SubjectState | None,
        gp: GroupProgress,
        cp: ConsumerProgress,
        session: str,
        max_n: int,
        tag_filter: RecordFilter | None,
        now_ms: int = 0,
        bytes_max: int | None = None,
    ) -> PullResult | None:
        """Hand ``cp`` up to ``max_n`` messages of ``st`` (of at most ``bytes_max`` bytes, if less
        than the store's bound, the first message always), the subject ``gp`` consumes (None
        before its first message): first what it pulled before and never acked (when its session
        changed), then the group's next messages (those matching ``tag_filter``, if any).
        For an ordered group (``gp.ordered``) the next messages are dispatched to their slots'
        owners first (``ordered_take``), and ``cp`` is handed what its pull log holds for it."""
        was = cp.session, cp.cursor
        if cp.session != session:
            cp.session = session
            cp.cursor = cp.ack_offset
        if st is None:
            return None
        self._recorded = False
        self._bytes_max = self.bytes_max if bytes_max is None else max(1, min(bytes_max, self.bytes_max))
        self.ordered.dispatched = False
        self.ordered.settling_ms = 0
        began = cp.cursor

        def again() -> None:
            if self._recorded:
                raise StoreError(f"a consume-log entry of {st.name!r} disagreed after a pull was recorded")
            cp.cursor = began

        try:
            return self._repairing_as_needed(st, lambda: self._pull(st, gp, cp, max_n, tag_filter, now_ms), again)
        except OSError as exc:
            if self._recorded:
                raise  # writing the action log failed: the store's to judge
            cp.session, cp.cursor = was
            raise PullReadError(
                f"reading the messages of {gp.subject!r} for a pull failed ({exc}); nothing was handed out, "
                "so pull again; if it goes on failing, the broker's disk is failing: see its log"
            ) from exc

    def _pull(
        self,
        st: SubjectState,
        gp: GroupProgress,
        cp: ConsumerProgress,
        max_n: int,
        tag_filter: RecordFilter | None,
        now_ms: int,
    ) -> PullResult | None:
        if gp.ordered:
            self._recorded = True  # a failed read after the dispatch is a failed pull, like any other
            self.ordered.dispatch(st, gp, cp, now_ms)
            self._recorded = False
            return self._take_own(st, gp, cp, max_n)
        return self._take(st, gp, cp, max_n, tag_filter)

    def _repairing_as_needed(self, st: SubjectState, attempt: Callable[[], _T], again: Callable[[], None]) -> _T:
        """``attempt()``; when it meets entries of ``st`` that disagree with their records, repair
        from the first of them and, after ``again()``, attempt again: at most ``_REPAIRS_MAX``
        repairs, then what still disagrees is damage."""
        repaired: set[int] = set()
        try:
            while True:  # bounded: each round repairs a new sequence, or is the last
                try:
                    return attempt()
                except _Disagrees as exc:
                    again()
                    if exc.seq in repaired or len(repaired) >= _REPAIRS_MAX:
                        self._repairing = True
                    else:
                        repaired.add(exc.seq)
                        self.repair(st, exc.seq)
        finally:
            self._repairing = False

    @contextlib.contextmanager
    def shared_reads(self) -> Iterator[None]:
        """Within: a group's next messages read for one group are taken by another that pulls the
        same ones, without reading and checking them again (``reads``)."""
        self.reads = {}
        try:
            yield
        finally:
            self.reads = None

    def repair(self, st: SubjectState, seq: int) -> int:
        """Rewrite the entries of ``st`` from ``seq`` on that disagree with their records (see
        clog_repair.py); returns how many were."""
        if self.reads is not None:
            self.reads.clear()
        fixed = clog_repair.repair(st.clog, self.mlog, seq, st.clog.next_seq)
        self.entries_repaired += fixed.rewritten
        log.error(
            "consume log of %r: entry %d disagreed with the message log (damaged): rewrote %d entries from %d on "
            "from the message log (%d bytes scanned)%s",
            st.name,
            seq,
            fixed.rewritten,
            seq,
            fixed.scanned_bytes,
            f"; {fixed.missing} records were not found whole (damaged): skipped" if fixed.missing else "",
        )
        return fixed.rewritten

    def _damage(self, st: SubjectState, seq: int, why: str) -> None:
        """Record ``seq`` of ``st`` is damaged: never handed out, logged once."""
        self.damaged_records += 1
        key = (st.name, seq)
        if key in self._damaged:
            return
        if len(self._damaged) >= _UNREPAIRABLE_MAX:
            self._damaged.pop(next(iter(self._damaged)))
        self._damaged[key] = None
        log.error("message %d of %r is damaged in the message log (%s): not handed out", seq, st.name, why)

    def _disagrees(self, st: SubjectState, seq: int) -> None:
        """Entry ``seq`` of ``st`` disagrees with its record: a repair first, damage after one."""
        if not self._repairing and (st.name, seq) not in self._damaged:
            raise _Disagrees(seq)
        self._damage(st, seq, "its record and its consume-log entry disagree, also after a repair")

    def _take(
        self, st: SubjectState, gp: GroupProgress, cp: ConsumerProgress, max_n: int, tag_filter: RecordFilter | None
    ) -> PullResult | None:
        out = PullResult([], [], 0, 0)
        for poff, seq, k in Progress.take_redelivery(cp, max_n):
            got, size = self._read_records(st.clog.read(seq, k), out.chunks, cp, poff, out.runs, st, seq)
            out = out._replace(messages=out.messages + got, nbytes=out.nbytes + size)
        left = max_n - out.messages
        budget = self._bytes_max - out.nbytes
        if left > 0 and budget > 0:
            if tag_filter is None:
                out = self._take_next(gp, cp, st, left, budget, out)
            else:
                out = self._take_matching(gp, cp, st, left, budget, tag_filter, out)
        return out if out.messages else None

    def _take_own(self, st: SubjectState, gp: GroupProgress, cp: ConsumerProgress, max_n: int) -> PullResult | None:
        """What ``cp``'s pull log holds that it was not handed yet (an ordered group's pull), less
        the messages of slots moving away from it (withheld: ``ordered_take``)."""
        out = PullResult([], [], 0, 0)
        away = self.ordered.away(gp, cp)
        for poff, seq, k in Progress.take_redelivery(cp, max_n):
            entries = st.clog.read(seq, k)
            kept: list[tuple[int, int]] = [(0, k)]
            if away:
                kept = []
                start = 0
                for i, (_off, _size, _ms, _bloom, order_slot) in enumerate(ENTRY.iter_unpack(entries)):
                    if order_slot and order_slot - 1 in away:
                        self.ordered.withhold(gp, cp, order_slot - 1, poff + i)
                        if i > start:
                            kept.append((start, i))
                        start = i + 1
                if k > start:
                    kept.append((start, k))
            for a, b in kept:
                got, size = self._read_records(
                    entries[a * ENTRY_BYTES : b * ENTRY_BYTES], out.chunks, cp, poff + a, out.runs, st, seq + a
                )
                out = out._replace(messages=out.messages + got, nbytes=out.nbytes + size)
        self.ordered.delivered(gp, cp)
        return out if out.messages else None

    def _take_next(
        self, gp: GroupProgress, cp: ConsumerProgress, st: SubjectState, left: int, budget: int, out: PullResult
    ) -> PullResult:
        start = max(gp.pull_offset, st.clog.min_seq)
        take = min(left, st.next_seq - start)
        if take <= 0:
            return out
        reads = self.reads
        key = (st.name, start, take, self.mlog.start)
        read = reads.get(key) if reads is not None else None
        skipped: list[int] = []
        if read is not None and read.nbytes <= budget:
            skip, k, got, size = read.skip, read.k, read.got, read.nbytes
            first = start + skip
            chunks = list(read.chunks)
            runs = [list(run) for run in read.runs]
        else:
            entries = st.clog.read(start, take)
            skip, k = kept_within(entries, self.mlog.start, budget)
            first = start + skip
            if not k:
                if skip:
                    self._record_pull(gp, cp, [], first)
                return out
            chunks = []
            runs = []
            got, size = self._read_records(
                entries[skip * ENTRY_BYTES : (skip + k) * ENTRY_BYTES], chunks, cp, 0, runs, st, first, skipped
            )
            if reads is not None and not skipped:
                reads[key] = _Read(skip, k, tuple(chunks), tuple((a, n) for a, n in runs), got, size)
        seq_runs = [[first, k]]
        if skipped:  # damaged records: the group's offset moves past them, nobody is handed them
            seq_runs = []
            for i in range(k):
                if i in skipped:
                    continue
                if seq_runs and seq_runs[-1][0] + seq_runs[-1][1] == first + i:
                    seq_runs[-1][1] += 1
                else:
                    seq_runs.append([first + i, 1])
        poff = self._record_pull(gp, cp, seq_runs, first + k)  # after the reads: see the module docstring
        for run in runs:
            run[0] += poff
        if out.runs and runs and out.runs[-1][0] + out.runs[-1][1] == runs[0][0]:
            out.runs[-1][1] += runs.pop(0)[1]
        out.runs.extend(runs)
        out.chunks.extend(chunks)
        return out._replace(messages=out.messages + got, nbytes=out.nbytes + size)

    def _record_pull(self, gp: GroupProgress, cp: ConsumerProgress, runs: list[list[int]], new_offset: int) -> int:
        self._recorded = True
        return self.progress.record_pull(gp, cp, runs, new_offset)

    def _take_matching(
        self,
        gp: GroupProgress,
        cp: ConsumerProgress,
        st: SubjectState,
        left: int,
        budget: int,
        tag_filter: RecordFilter,
        out: PullResult,
    ) -> PullResult:
        """Scan from the group's pull offset for messages ``tag_filter`` matches."""
        first = seq = max(gp.pull_offset, st.clog.min_seq)
        end = min(st.next_seq, seq + _SCAN_ENTRIES_MAX)
        log_start = self.mlog.start
        read_into = self.mlog.reader()
        matched: list[tuple[int, bytes]] = []  # (seq, record)
        nbytes = 0
        while seq < end and len(matched) < left and nbytes < budget:
            n = min(_SCAN_CHUNK_ENTRIES, end - seq)
            entries = st.clog.read(seq, n)
            for i, (off, size, ms, bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
                if len(matched) >= left or (matched and nbytes + size > budget):
                    seq += i
                    break
                if off < log_start or not tag_filter.maybe(bloom):
                    continue
                if (st.name, seq + i) in self._damaged:
                    continue
                if size < RECORD_HEADER_BYTES or off + size > self.mlog.end:
                    self._disagrees(st, seq + i)
                    continue
                chunk: list[bytes] = []
                read_into(off, size, chunk)
                record = chunk[0] if len(chunk) == 1 else b"".join(chunk)
                found = check_record(record, 0, size, seq + i, ms)
                if found != GOOD:
                    if found == DAMAGED:
                        self._damage(st, seq + i, "it fails its CRC")
                    else:
                        self._disagrees(st, seq + i)
                    continue
                if tag_filter.matches_record(record):
                    matched.append((seq + i, record))
                    nbytes += size
                if tag_filter.full():  # the rest waits for the next pull (a group filter's bounds)
                    seq += i + 1
                    break
            else:
                seq += n
                continue
            break
        if seq == first:
            return out
        runs: list[list[int]] = []
        for s, _record in matched:
            if runs and runs[-1][0] + runs[-1][1] == s:
                runs[-1][1] += 1
            else:
                runs.append([s, 1])
        poff = self._record_pull(gp, cp, runs, seq)
        if matched:
            out.runs.append([poff, len(matched)])
            out.chunks.extend(record for _s, record in matched)
        return out._replace(messages=out.messages + len(matched), nbytes=out.nbytes + nbytes)

    def _read_records(
        self,
        entries: bytes,
        chunks: list[bytes],
        cp: ConsumerProgress | None,
        poff: int,
        runs: list[list[int]],
        st: SubjectState,
        seq: int,
        skipped: list[int] | None = None,
    ) -> tuple[int, int]:
        """Append the records of ``entries`` (of ``st``, from sequence ``seq``; pull-log offsets
        from ``poff``) to ``chunks`` and their offsets to ``runs``, coalescing adjacent records
        into one read, each checked against its entry.

        A damaged record is left out: with ``skipped`` (a pull not yet recorded) its index is
        appended there and the pull-log offsets stay dense; without it (records in the pull log
        already), the consumer is done with it, as with one retention removed.
        """
        if len(entries) >= FAST_ENTRIES_MIN * ENTRY_BYTES and not self._damaged and not self.checked.damaged:
            fast = read_fast(self.mlog, self.checked.crc_from, entries, chunks, poff, runs, seq)
            if fast is not None:
                return fast
        read_into = self.mlog.reader()
        log_start = self.mlog.start
        log_end = self.mlog.end
        first_chunk = len(chunks)
        # (index, size, stored_ms, the chunk its run begins at, whether its CRC is checked)
        listed: list[tuple[int, int, int, int, bool]] = []
        run_off = -1
        run_end = -1
        run_chunk = first_chunk
        damaged = self._damaged
        disagree: list[int] = []  # entries that disagree with their records
        crc_from = self.checked.crc_from
        damaged_log = self.checked.is_damaged if self.checked.damaged else None
        bad: list[int] = []
        for i, (off, size, ms, _bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
            if off < log_start:
                # removed by retention while pulled and unacked: nothing to send, so it is done
                # (an ack the broker makes itself; replay reaches the same state by the same rule)
                if cp is not None:
                    Progress.apply_ack(cp, [[poff + i, poff + i + 1]])
                continue
            if size < RECORD_HEADER_BYTES or off + size > log_end or (damaged and (st.name, seq + i) in damaged):
                if (st.name, seq + i) not in damaged:
                    disagree.append(i)
                bad.append(i)
                continue
            if damaged_log is not None and damaged_log(off):
                self._damage(st, seq + i, "recovery found its bytes damaged")
                bad.append(i)
                continue
            if off != run_end:
                if run_end > run_off >= 0:
                    read_into(run_off, run_end - run_off, chunks)
                run_off, run_end = off, off
                run_chunk = len(chunks)
            run_end += size
            listed.append((i, size, ms, run_chunk, off < crc_from))
        if run_end > run_off >= 0:
            read_into(run_off, run_end - run_off, chunks)
        # check each record against its entry (inline: this runs once per record handed out)
        unpack = RECORD_HEADER.unpack_from
        crc32 = crc32c.crc32c
        dense = skipped is not None
        got = 0
        nbytes = 0
        ci = -1
        p = 0
        started = -1
        chunk = b""
        view = memoryview(chunk)
        retry = False
        for i, size, ms, at, check_crc in listed:
            if at != started:
                started, ci, p = at, at, 0
                chunk = chunks[ci]
                view = memoryview(chunk)
            elif p >= len(chunk) and ci + 1 < len(chunks):
                ci, p = ci + 1, 0
                chunk = chunks[ci]
                view = memoryview(chunk)
            end = p + size
            if end <= len(chunk):
                magic, crc, length, sequence, stored = unpack(chunk, p)
                ok = (
                    magic == RECORD_MAGIC
                    and length + RECORD_HEADER_BYTES == size
                    and sequence == seq + i
                    and stored == ms
                    and (not check_crc or crc32(view[p + 8 : end]) == crc)
                )
            else:
                ok = False
            p = end
            if not ok:
                if check_record(chunk, end - size, size, seq + i, ms) == DAMAGED:
                    self._damage(st, seq + i, "it fails its CRC")
                else:
                    disagree.append(i)
                bad.append(i)
                retry = True
                continue
            at_log = poff + (got if dense else i)
            if runs and runs[-1][0] + runs[-1][1] == at_log:
                runs[-1][1] += 1
            else:
                runs.append([at_log, 1])
            got += 1
            nbytes += size
        if disagree:  # a repair from the first of them, or, after one, they are damage
            if not self._repairing:
                raise _Disagrees(seq + min(disagree))
            for i in disagree:
                self._disagrees(st, seq + i)
        if retry:  # damaged records go: the good ones are copied out of the chunks one by one
            chunks[first_chunk:] = without(chunks[first_chunk:], first_chunk, listed, set(bad))
        if bad:
            if skipped is not None:
                skipped.extend(bad)
            elif cp is not None:
                Progress.apply_ack(cp, [[poff + i, poff + i + 1] for i in sorted(bad)])
        return got, nbytes

    def read_range(self, st: SubjectState | None, from_seq: int, max_n: int) -> tuple[int, int, list[bytes]]:
        """Up to ``max_n`` visible records of ``st`` from sequence ``from_seq`` (or the first
        one kept, if retention removed it), outside any consumer group: ``(first, count, chunks)``.

        The entries are read as one numpy array: skipping removed records and the byte budget
        are found without a Python loop per record, and the records are read and checked as a
        pull's are. A damaged record is left out: the answer begins after it (a reader sees
        the gap, as after retention) or ends before it.
        """
        if st is None:
            return from_seq, 0, []
        first = max(from_seq, st.clog.min_seq)
        raw = st.clog.read(first, max(0, min(max_n, st.visible_seq - first)))
        entries = np.frombuffer(raw, dtype=ENTRY_DTYPE)
        kept = np.flatnonzero(entries["offset"] >= self.mlog.start)
        if not len(kept):
            return first + len(entries), 0, []
        entries = entries[kept[0] :]
        skip = int(kept[0])
        sizes = entries["size"].astype(np.int64)
        within = np.cumsum(sizes) <= self.bytes_max
        count = max(1, int(np.count_nonzero(within)))
        wanted = entries[:count].tobytes()
        chunks: list[bytes] = []
        skipped: list[int] = []

        def attempt() -> None:
            nonlocal wanted, sizes
            chunks.clear()
            skipped.clear()
            wanted = st.clog.read(first + skip, count)  # again after a repair
            sizes = np.frombuffer(wanted, dtype=ENTRY_DTYPE)["size"].astype(np.int64)
            self._read_records(wanted, chunks, None, 0, [], st, first + skip, skipped)

        self._repairing_as_needed(st, attempt, lambda: None)
        if skipped:  # damaged records: the answer is the good ones after the first run of them
            bad = set(skipped)
            good = [i for i in range(count) if i not in bad]
            begin = good[0] if good else count
            end = next((i for i in range(begin, count) if i in bad), count)
            data = b"".join(chunks)[: int(sizes[begin:end].sum())]
            return first + skip + begin, end - begin, [data] if data else []
        return first + skip, count, chunks
