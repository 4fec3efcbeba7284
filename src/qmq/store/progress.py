"""Consumer progress: consumer groups, pull logs and ack offsets, as pure state.

A consumer group on a subject has one *pull offset*: the next consume-log sequence to hand
out. A pull gives the pulling consumer the next range of the subject and appends it to the
consumer's *pull log*: its pull-log offsets 0, 1, 2, … map to the consume-log sequences it
received. A consumer's progress is its *ack offset*: every pull-log offset below it is done.
Acks arrive as ranges, in any order; the ack offset advances only over the contiguous
acknowledged prefix, so a message finished late is never skipped.

Members share the group's pull offset, so consumers join and leave at any time and a backlog
drains faster as members are added — there are no partitions.

Pull-log positions are never handed out twice, also when a power loss (under flush =
"periodic") or a failover to a slave that lacked a pull's record (a read-only group answers
pulls all the same) undid pulls that were answered: a consumer's acks of what those pulls
handed it name positions the broker no longer holds, and they must not acknowledge other
messages the consumer's next pulls receive there (which it may not have handled yet). So a
broker that starts again over what it held, and a slave promoted, opens a new *stretch*
(``next_stretch``): the first pull of each consumer after it begins at the stretch's start,
above every position handed out before (the positions skipped count as acknowledged: nothing
is there), and a stale ack is a no-op; the messages it meant come again (at least once). The
broker counts the positions such an ack names (``unheld``: past the pull log's end, or in a
skipped stretch) and tells the consumer, whose SDK does not count that ack as done.

Nothing here does I/O: the store logs each change to the action log and replays the log
through the same methods after a restart.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

# Runs of pulled-but-unacked entries one PULL answer hands again: its header lists each as
# [pull_offset, count] (~15 bytes at most), so 2,000 stay far inside frame_header_bytes_max.
REDELIVERY_RUNS_MAX = 2_000

# A stretch starts at (seconds since STRETCH_EPOCH_S) << STRETCH_BITS, and above every position
# this broker has seen: it lies above the positions of every earlier stretch, also those lost,
# unless one consumer pulled 4,194,304 entries a second (or the clock went back). Positions stay
# below 2**53, exact as JavaScript numbers, until the 2080s.
STRETCH_BITS = 22
STRETCH_EPOCH_S = 1_577_836_800  # 2020-01-01
# The skipped stretches a consumer's progress keeps (one per restart or promotion it pulled across)
SKIPPED_KEPT_MAX = 8


@dataclass(slots=True)
class ConsumerProgress:
    consumer_id: str
    pull_log_end: int = 0
    ack_offset: int = 0
    # runs of the pull log at or after ack_offset: [pull_offset, seq, count], in order
    runs: deque[list[int]] = field(default_factory=deque)
    # acknowledged ranges beyond the contiguous prefix: [start, end), sorted and disjoint
    acked: list[list[int]] = field(default_factory=list)
    # not persisted: the connection incarnation last seen, and where re-delivery stands
    session: str | None = None
    cursor: int = 0
    last_seen_ms: int = 0
    since_ms: int = 0  # when this broker first saw it (a pull or an ack) since the broker started; 0: not yet
    parked: int = 0  # long polls of this consumer waiting now (a live consumer of an ordered group)
    # not persisted: the last SKIPPED_KEPT_MAX stretches of positions skipped ([start, end)), so an
    # ack naming them is told apart from one of acknowledged positions (``unheld``); None: none
    skipped: list[list[int]] | None = None

    @property
    def unacked(self) -> int:
        return self.pull_log_end - self.ack_offset - sum(e - s for s, e in self.acked)


@dataclass(slots=True)
class GroupProgress:
    subject: str
    group: str
    pull_offset: int
    consumers: dict[str, ConsumerProgress] = field(default_factory=dict)
    # not persisted: what the group's consumers said in their last pull
    max_retries: int = 16
    # pulled with ``ordered``: slots are served to their owners (ordered_take); persisted, by the
    # group's PULL actions and the checkpoint's "ordered_groups", so a restart keeps it
    ordered: bool = False

    def consumer(self, consumer_id: str) -> ConsumerProgress:
        cp = self.consumers.get(consumer_id)
        if cp is None:
            cp = self.consumers[consumer_id] = ConsumerProgress(consumer_id)
        return cp


def _merge_range(acked: list[list[int]], start: int, end: int) -> None:
    """Insert [start, end) into a sorted list of disjoint ranges, merging neighbours."""
    i = 0
    n = len(acked)
    while i < n and acked[i][1] < start:
        i += 1
    j = i
    while j < n and acked[j][0] <= end:
        start = min(start, acked[j][0])
        end = max(end, acked[j][1])
        j += 1
    acked[i:j] = [[start, end]]


def _advance(cp: ConsumerProgress) -> int:
    """Move the ack offset over the contiguous acknowledged prefix; drop the runs below it."""
    acked = cp.acked
    while acked and acked[0][0] <= cp.ack_offset:
        cp.ack_offset = max(cp.ack_offset, acked.pop(0)[1])
    runs = cp.runs
    while runs and runs[0][0] + runs[0][2] <= cp.ack_offset:
        runs.popleft()
    return cp.ack_offset


def _skip_to(cp: ConsumerProgress, start: int) -> None:
    """Move the end of ``cp``'s pull log to ``start``: the positions skipped hold nothing and
    count as acknowledged, so an ack naming them changes nothing."""
    end = cp.pull_log_end
    _merge_range(cp.acked, end, start)
    if cp.skipped is None:
        cp.skipped = []
    cp.skipped.append([end, start])
    del cp.skipped[:-SKIPPED_KEPT_MAX]
    cp.pull_log_end = start
    if cp.cursor == end:
        cp.cursor = start
    _advance(cp)


class Progress:
    def __init__(self) -> None:
        self.groups: dict[tuple[str, str], GroupProgress] = {}

    def get(self, subject: str, group: str) -> GroupProgress | None:
        return self.groups.get((subject, group))

    def create_group(self, subject: str, group: str, start_seq: int) -> GroupProgress:
        gp = self.groups.get((subject, group))
        if gp is None:
            gp = self.groups[(subject, group)] = GroupProgress(subject, group, start_seq)
        return gp

    def groups_of(self, subject: str) -> list[GroupProgress]:
        return [gp for (s, _g), gp in self.groups.items() if s == subject]

    # -- consumers gone ----------------------------------------------------------------

    def gone_consumers(self, now_ms: int, gone_ms: int) -> list[tuple[GroupProgress, list[str]]]:
        """By group, the consumers silent for ``gone_ms`` with nothing unacknowledged: nothing
        of theirs is left to redeliver, so they may be forgotten."""
        out: list[tuple[GroupProgress, list[str]]] = []
        for gp in self.groups.values():
            ids = [c.consumer_id for c in gp.consumers.values() if now_ms - c.last_seen_ms >= gone_ms and not c.unacked]
            if ids:
                out.append((gp, ids))
        return out

    @staticmethod
    def forget(gp: GroupProgress, consumer_ids: list[str]) -> None:
        """Drop consumers of ``gp``; one that pulls again starts a new pull log at 0."""
        for consumer_id in consumer_ids:
            gp.consumers.pop(consumer_id, None)

    # -- pulls -------------------------------------------------------------------------

    @staticmethod
    def take_redelivery(
        cp: ConsumerProgress, max_n: int, runs_max: int = REDELIVERY_RUNS_MAX
    ) -> list[tuple[int, int, int]]:
        """Pulled-but-unacked entries to hand again to a consumer that came back.

        Returns runs ``(pull_offset, seq, count)`` from the consumer's cursor on, skipping
        acknowledged ranges, at most ``max_n`` entries in at most ``runs_max`` runs (each is one
        ``[pull_offset, count]`` of the PULL answer's header), and advances the cursor.
        """
        out: list[tuple[int, int, int]] = []
        if cp.cursor >= cp.pull_log_end or max_n <= 0:
            cp.cursor = max(cp.cursor, cp.pull_log_end)
            return out
        cursor = max(cp.cursor, cp.ack_offset)
        left = max_n
        acked = cp.acked
        ai = 0
        for poff, seq, count in cp.runs:
            if left <= 0 or len(out) >= runs_max:
                break
            end = poff + count
            if end <= cursor:
                continue
            p = max(poff, cursor)
            while p < end and left > 0 and len(out) < runs_max:
                while ai < len(acked) and acked[ai][1] <= p:
                    ai += 1
                if ai < len(acked) and acked[ai][0] <= p:
                    p = acked[ai][1]
                    continue
                stop = end
                if ai < len(acked) and acked[ai][0] < stop:
                    stop = acked[ai][0]
                k = min(stop - p, left)
                out.append((p, seq + (p - poff), k))
                left -= k
                p += k
            cursor = p
        cp.cursor = cursor if left <= 0 or len(out) >= runs_max else cp.pull_log_end
        return out

    def next_stretch(self, now_ms: int) -> int:
        """Where pull logs go on after a restart or a promotion (the module docstring): above
        every position handed out before, by the clock, and above every position seen here."""
        by_clock = max(0, now_ms // 1000 - STRETCH_EPOCH_S) << STRETCH_BITS
        seen = max((cp.pull_log_end for gp in self.groups.values() for cp in gp.consumers.values()), default=0)
        return max(by_clock, ((seen >> STRETCH_BITS) + 1) << STRETCH_BITS)

    @staticmethod
    def record_pull(
        gp: GroupProgress, cp: ConsumerProgress, runs: list[list[int]], new_pull_offset: int, start: int = 0
    ) -> int:
        """Append the consume-log runs ``[[seq, count], ...]`` to the consumer's pull log, from
        ``start`` when that lies past its end (a new stretch: the positions between are skipped).

        Returns the pull-log offset of the first entry. The group's pull offset moves to
        ``new_pull_offset`` (past entries a filter skipped, too).
        """
        if start > cp.pull_log_end:
            _skip_to(cp, start)
        start = cp.pull_log_end
        p = start
        for seq, count in runs:
            if count <= 0:
                continue
            last = cp.runs[-1] if cp.runs else None
            if last is not None and last[0] + last[2] == p and last[1] + last[2] == seq:
                last[2] += count
            else:
                cp.runs.append([p, seq, count])
            p += count
        cp.pull_log_end = p
        if cp.cursor == start:
            cp.cursor = p
        gp.pull_offset = max(gp.pull_offset, new_pull_offset)
        return start

    @staticmethod
    def cut_pull_log(cp: ConsumerProgress, seq_end: int) -> int:
        """Drop the tail of ``cp``'s pull log that names sequences from ``seq_end`` on (messages a
        power loss took while the pull's record survived: recovery, under flush = "sync", where
        such a pull was never answered, see take.py). Returns how many entries went.

        Only the tail: a pull answered before the loss named durable messages, and every pull
        after the first one never answered was not answered either."""
        end = cp.pull_log_end
        runs = cp.runs
        while runs:
            poff, seq, count = runs[-1]
            if seq + count <= seq_end:
                break
            keep = max(0, seq_end - seq)
            end = poff + keep
            if keep:
                runs[-1][2] = keep
                break
            runs.pop()
        end = max(end, cp.ack_offset)
        cut = cp.pull_log_end - end
        if cut > 0:
            cp.pull_log_end = end
            cp.cursor = min(cp.cursor, end)
            cp.acked = [[a, min(b, end)] for a, b in cp.acked if a < end]
        return max(cut, 0)

    # -- acks --------------------------------------------------------------------------

    @staticmethod
    def unheld(cp: ConsumerProgress, ranges: list[list[int]]) -> int:
        """How many positions of ``ranges`` this broker never handed out to ``cp``: past the end
        of its pull log, or in a stretch skipped (kept for the last SKIPPED_KEPT_MAX). An ack of
        them acknowledges nothing; they were handed out by a master since replaced, or by this
        broker before a power loss undid the pull, and their messages come again."""
        n = 0
        end = cp.pull_log_end
        skipped = cp.skipped or ()
        for start, stop in ranges:
            if stop > end:
                n += stop - max(start, end)
            for lo, hi in skipped:
                lo, hi = max(start, lo), min(stop, hi)
                if lo < hi:
                    n += hi - lo
        return n

    @staticmethod
    def apply_ack(cp: ConsumerProgress, ranges: list[list[int]]) -> int:
        """Mark pull-log ranges done; advance the ack offset over the contiguous prefix."""
        for r in ranges:
            start, end = max(r[0], cp.ack_offset), min(r[1], cp.pull_log_end)
            if start < end:
                _merge_range(cp.acked, start, end)
        return _advance(cp)

    # -- checkpoints -------------------------------------------------------------------

    def snapshot(self) -> list[Any]:
        out: list[Any] = []
        for gp in self.groups.values():
            consumers = [
                [
                    cp.consumer_id,
                    cp.pull_log_end,
                    cp.ack_offset,
                    [list(r) for r in cp.runs],
                    [list(a) for a in cp.acked],
                ]
                for cp in gp.consumers.values()
            ]
            out.append([gp.subject, gp.group, gp.pull_offset, consumers])
        return out

    @classmethod
    def from_snapshot(cls, snap: list[Any]) -> Progress:
        progress = cls()
        for subject, group, pull_offset, consumers in snap:
            gp = progress.create_group(subject, group, pull_offset)
            for consumer_id, end, ack, runs, acked in consumers:
                gp.consumers[consumer_id] = ConsumerProgress(
                    consumer_id, end, ack, deque(list(r) for r in runs), [list(a) for a in acked], cursor=end
                )
        return progress
