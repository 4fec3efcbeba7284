"""Pulls: what a consumer receives from a subject and how the store reads it.

A pull hands a consumer first what it pulled before and never acked (when its session
changed), then the group's next visible messages: the range after the group's pull offset,
or, for a group subscribed with tags, the matching messages in it. ``read_range`` reads a
subject by sequence outside any group (READ, for data jobs).

Entries whose records retention removed are skipped (never handed out). A filtered take
scans at most ``_SCAN_ENTRIES_MAX`` entries per pull, so a subject full of other tags costs
bounded work; the group's pull offset moves past what was scanned either way.

A pull reads everything it hands out before it records the pull in the action log, so a read
that fails (a failing disk) changes nothing: that pull is answered with ``PullReadError`` and
the consumer pulls the same messages again; the store goes on.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from qmq.store.action_log import ProgressLog
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, ENTRY_DTYPE
from qmq.store.datadir import StoreError
from qmq.store.message_log import MessageLog
from qmq.store.ordered_take import OrderedDispatch
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.subjects import SubjectState
from qmq.store.tags import TagFilter

_SCAN_ENTRIES_MAX = 20_000
_SCAN_CHUNK_ENTRIES = 2048


class PullResult(NamedTuple):
    runs: list[list[int]]  # [pull_offset, count]
    chunks: list[bytes]  # stored records, back to back
    messages: int
    nbytes: int


class PullReadError(StoreError):
    """Reading what a pull would hand out failed; nothing of the pull was recorded."""


class Pulls:
    """Reads for pulls: records from the message log by a subject's consume-log entries, each
    pull logged and applied through ``progress``; at most ``bytes_max`` bytes of records a pull."""

    def __init__(self, mlog: MessageLog, progress: ProgressLog, bytes_max: int, ordered_lease_ms: int) -> None:
        self.mlog = mlog
        self.progress = progress
        self.bytes_max = bytes_max
        self.ordered = OrderedDispatch(mlog, progress, ordered_lease_ms)
        self._recorded = False  # the pull being made wrote the action log (see ``pull``)

    def pull(
        self,
        st: SubjectState | None,
        gp: GroupProgress,
        cp: ConsumerProgress,
        session: str,
        max_n: int,
        tag_filter: TagFilter | None,
        now_ms: int = 0,
    ) -> PullResult | None:
        """Hand ``cp`` up to ``max_n`` messages of ``st``, the subject ``gp`` consumes (None
        before its first message): first what it pulled before and never acked (when its session
        changed), then the group's next visible messages (those matching ``tag_filter``, if any).
        For an ordered group (``gp.ordered``) the next messages are dispatched to their slots'
        owners first (``ordered_take``), and ``cp`` is handed what its pull log holds for it."""
        was = cp.session, cp.cursor
        if cp.session != session:
            cp.session = session
            cp.cursor = cp.ack_offset
        if st is None:
            return None
        self._recorded = False
        self.ordered.dispatched = False
        self.ordered.settling_ms = 0
        try:
            if gp.ordered:
                self._recorded = True  # a failed read after the dispatch is a failed pull, like any other
                self.ordered.dispatch(st, gp, cp, now_ms)
                self._recorded = False
                return self._take_own(st, gp, cp, max_n)
            return self._take(st, gp, cp, max_n, tag_filter)
        except OSError as exc:
            if self._recorded:
                raise  # writing the action log failed: the store's to judge
            cp.session, cp.cursor = was
            raise PullReadError(
                f"reading the messages of {gp.subject!r} for a pull failed ({exc}); nothing was handed out, "
                "so pull again; if it goes on failing, the broker's disk is failing: see its log"
            ) from exc

    def _take(
        self, st: SubjectState, gp: GroupProgress, cp: ConsumerProgress, max_n: int, tag_filter: TagFilter | None
    ) -> PullResult | None:
        out = PullResult([], [], 0, 0)
        for poff, seq, k in Progress.take_redelivery(cp, max_n):
            got, size = self._read_records(st.clog.read(seq, k), out.chunks, cp, poff, out.runs)
            out = out._replace(messages=out.messages + got, nbytes=out.nbytes + size)
        left = max_n - out.messages
        budget = self.bytes_max - out.nbytes
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
                    entries[a * ENTRY_BYTES : b * ENTRY_BYTES], out.chunks, cp, poff + a, out.runs
                )
                out = out._replace(messages=out.messages + got, nbytes=out.nbytes + size)
        self.ordered.delivered(gp, cp)
        return out if out.messages else None

    def _take_next(
        self, gp: GroupProgress, cp: ConsumerProgress, st: SubjectState, left: int, budget: int, out: PullResult
    ) -> PullResult:
        start = max(gp.pull_offset, st.clog.min_seq)
        take = min(left, st.visible_seq - start)
        if take <= 0:
            return out
        entries = st.clog.read(start, take)
        log_start = self.mlog.start
        skip = 0
        for off, _size, _ms, _bloom, _r in ENTRY.iter_unpack(entries):
            if off >= log_start:
                break
            skip += 1
        k = 0
        acc = 0
        for _off, size, _ms, _bloom, _r in ENTRY.iter_unpack(entries[skip * ENTRY_BYTES :]):
            if k and acc + size > budget:
                break
            acc += size
            k += 1
        first = start + skip
        if not k:
            if skip:
                self._record_pull(gp, cp, [], first)
            return out
        chunks: list[bytes] = []
        runs: list[list[int]] = []
        got, size = self._read_records(entries[skip * ENTRY_BYTES : (skip + k) * ENTRY_BYTES], chunks, cp, 0, runs)
        poff = self._record_pull(gp, cp, [[first, k]], first + k)  # after the reads: see the module docstring
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
        tag_filter: TagFilter,
        out: PullResult,
    ) -> PullResult:
        """Scan from the group's pull offset for messages ``tag_filter`` matches."""
        first = seq = max(gp.pull_offset, st.clog.min_seq)
        end = min(st.visible_seq, seq + _SCAN_ENTRIES_MAX)
        log_start = self.mlog.start
        matched: list[tuple[int, bytes]] = []  # (seq, record)
        nbytes = 0
        while seq < end and len(matched) < left and nbytes < budget:
            n = min(_SCAN_CHUNK_ENTRIES, end - seq)
            entries = st.clog.read(seq, n)
            for i, (off, size, _ms, bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
                if len(matched) >= left or (matched and nbytes + size > budget):
                    seq += i
                    break
                if off < log_start or not tag_filter.maybe(bloom):
                    continue
                chunk: list[bytes] = []
                self.mlog.read_into(off, size, chunk)
                record = chunk[0] if len(chunk) == 1 else b"".join(chunk)
                if tag_filter.matches_record(record):
                    matched.append((seq + i, record))
                    nbytes += size
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
        self, entries: bytes, chunks: list[bytes], cp: ConsumerProgress, poff: int, runs: list[list[int]]
    ) -> tuple[int, int]:
        """Append the records of ``entries`` (pull-log offsets from ``poff``) to ``chunks`` and
        their offsets to ``runs``, coalescing adjacent records into one read."""
        read_into = self.mlog.read_into
        log_start = self.mlog.start
        run_off = -1
        run_end = -1
        got = 0
        nbytes = 0
        for i, (off, size, _ms, _bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
            if off < log_start:
                # removed by retention while pulled and unacked: nothing to send, so it is done
                # (an ack the broker makes itself; replay reaches the same state by the same rule)
                Progress.apply_ack(cp, [[poff + i, poff + i + 1]])
                continue
            if runs and runs[-1][0] + runs[-1][1] == poff + i:
                runs[-1][1] += 1
            else:
                runs.append([poff + i, 1])
            if off == run_end:
                run_end += size
            else:
                if run_end > run_off >= 0:
                    read_into(run_off, run_end - run_off, chunks)
                run_off, run_end = off, off + size
            got += 1
            nbytes += size
        if run_end > run_off >= 0:
            read_into(run_off, run_end - run_off, chunks)
        return got, nbytes

    def read_range(self, st: SubjectState | None, from_seq: int, max_n: int) -> tuple[int, int, list[bytes]]:
        """Up to ``max_n`` visible records of ``st`` from sequence ``from_seq`` (or the first
        one kept, if retention removed it), outside any consumer group: ``(first, count, chunks)``.

        The entries are read as one numpy array: skipping removed records, the byte budget and
        the runs of adjacent records (one read each) are found without a Python loop per record.
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
        offsets = entries["offset"][:count].astype(np.int64)
        sizes = sizes[:count]
        breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + sizes[:-1]) + 1
        chunks: list[bytes] = []
        for run in np.split(np.arange(count), breaks):
            start_off = int(offsets[run[0]])
            self.mlog.read_into(start_off, int(offsets[run[-1]] + sizes[run[-1]]) - start_off, chunks)
        return first + skip, count, chunks
