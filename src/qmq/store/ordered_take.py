"""Pulls of ordered consumer groups: each slot's messages go to its owner only (docs/ordered.md).

A pull of an ordered group does not hand the puller the next range of the subject. It
*dispatches*: the entries after the group's pull offset are appended, in order, to the pull log
of their slot's owner (``slots.OrderedGroup``) as ordinary PULL actions, and the puller is then
handed what its own pull log holds that it has not received (the same path that re-delivers
after a reconnect). Consumers that were handed messages by another's pull get them on their next
pull; a long poll parked meanwhile is woken by the broker (``dispatched``).

A dispatch stops at the first entry of a slot that is moving (its owner still holds some of it)
and at the first entry whose owner already holds ``ORDERED_UNACKED_MAX`` unacknowledged
messages; it scans at most ``_SCAN_ENTRIES_MAX`` entries. Entries without an order key go to the
puller. A slot whose owner's lease ran out moves with the owner's unacknowledged messages of it,
appended to the new owner's pull log before anything newer and acknowledged for the old owner.
"""

from __future__ import annotations

from qmq.store.action_log import ProgressLog
from qmq.store.consume_log import ENTRY
from qmq.store.message_log import MessageLog
from qmq.store.progress import ConsumerProgress, GroupProgress
from qmq.store.slots import ORDERED_UNACKED_MAX, OrderedGroup
from qmq.store.subjects import SubjectState

_SCAN_ENTRIES_MAX = 4096


class OrderedDispatch:
    """The slot owners of every ordered group of one broker, and their dispatch."""

    def __init__(self, mlog: MessageLog, progress: ProgressLog, lease_ms: int) -> None:
        self.mlog = mlog
        self.progress = progress
        self.lease_ms = lease_ms
        self.groups: dict[tuple[str, str], OrderedGroup] = {}
        self.dispatched = False  # the last dispatch handed messages to a consumer other than the puller

    def forget(self) -> None:
        """Drop every group's state (the store was rewound or reopened): rebuilt on the next pull."""
        self.groups.clear()

    def dispatch(self, st: SubjectState, gp: GroupProgress, puller: ConsumerProgress, now_ms: int) -> None:
        """Bring slot ownership up to date and append the next entries to their owners' pull logs."""
        self.dispatched = False
        og = self.groups.get((gp.subject, gp.group))
        if og is None:
            og = self.groups[(gp.subject, gp.group)] = self._rebuild(st, gp, now_ms)
        for cid in [c for c in og.handed if c not in gp.consumers]:
            del og.handed[cid]  # forgotten (nothing unacknowledged): a new pull log starts at 0
        og.prune(puller)
        live = og.live(gp, now_ms, self.lease_ms, puller.consumer_id)
        for owner, slots in og.orphaned(live).items():
            self._take_over(gp, og, owner, slots, live)
        if live != og.live_ids:
            og.live_ids = live
            og.balance(live)
        og.finish_moves(gp)
        self._dispatch(st, gp, og, puller, live)

    def _rebuild(self, st: SubjectState, gp: GroupProgress, now_ms: int) -> OrderedGroup:
        """After a start or promotion: a consumer holding unacknowledged messages of a slot owns it."""
        og = OrderedGroup(started_ms=now_ms)
        for cp in gp.consumers.values():
            for poff, seq, count in cp.runs:
                raw = st.clog.read(seq, count)
                for i, (_off, _size, _ms, _bloom, order_slot) in enumerate(ENTRY.iter_unpack(raw)):
                    if order_slot:
                        og.hand(cp.consumer_id, order_slot - 1, [poff + i])
            og.prune(cp)
            for slot in og.handed.get(cp.consumer_id, {}):
                og.owners.setdefault(slot, cp.consumer_id)
        return og

    def _take_over(
        self, gp: GroupProgress, og: OrderedGroup, owner: str, slots: list[int], live: frozenset[str]
    ) -> None:
        """Move the slots of ``owner`` (lease ran out) with its unacknowledged messages of them."""
        load = og.load(live)
        new_owner: dict[int, str] = {}
        for slot in slots:
            og.moving.pop(slot, None)
            target = og.least_loaded(load)
            load[target] += 1
            og.owners[slot] = target
            new_owner[slot] = target
        old = gp.consumers.get(owner)
        if old is None:
            return
        moved = [(poff, slot) for poff, slot in og.unacked_of(old) if slot in new_owner]
        if not moved:
            return
        seq_of = _SeqOf(old)
        by_target: dict[str, list[tuple[int, int]]] = {}
        for poff, slot in moved:
            by_target.setdefault(new_owner[slot], []).append((seq_of(poff), slot))
        for target, items in by_target.items():
            self._append(gp, og, gp.consumer(target), items, gp.pull_offset)
        self.progress.ack(gp, old, [[p, p + 1] for p, _slot in moved])
        og.handed.pop(owner, None)
        self.dispatched = True

    def _append(
        self, gp: GroupProgress, og: OrderedGroup, cp: ConsumerProgress, items: list[tuple[int, int]], new_offset: int
    ) -> None:
        """Append consume-log entries ``(seq, slot)`` to ``cp``'s pull log without handing them yet
        (its next pull hands them: its cursor stays where it was)."""
        runs: list[list[int]] = []
        for seq, _slot in items:
            if runs and runs[-1][0] + runs[-1][1] == seq:
                runs[-1][1] += 1
            else:
                runs.append([seq, 1])
        cursor = cp.cursor
        start = self.progress.record_pull(gp, cp, runs, new_offset)
        cp.cursor = cursor
        for i, (_seq, slot) in enumerate(items):
            if slot >= 0:
                og.hand(cp.consumer_id, slot, [start + i])

    def _dispatch(
        self, st: SubjectState, gp: GroupProgress, og: OrderedGroup, puller: ConsumerProgress, live: frozenset[str]
    ) -> None:
        start = max(gp.pull_offset, st.clog.min_seq)
        n = min(_SCAN_ENTRIES_MAX, st.visible_seq - start)
        if n <= 0:
            return
        entries = st.clog.read(start, n)
        log_start = self.mlog.start
        load = og.load(live)
        out: dict[str, list[tuple[int, int]]] = {}
        room: dict[str, int] = {}
        seq = start
        for off, _size, _ms, _bloom, order_slot in ENTRY.iter_unpack(entries):
            if off < log_start:
                seq += 1  # removed by retention: nothing to hand out
                continue
            if order_slot:
                slot = order_slot - 1
                if slot in og.moving:
                    break
                owner = og.owners.get(slot)
                if owner is None:
                    owner = og.place_new(slot, live, load)
            else:
                slot, owner = -1, puller.consumer_id
            left = room.get(owner)
            if left is None:
                held = gp.consumers.get(owner)
                left = ORDERED_UNACKED_MAX - (held.unacked if held is not None else 0)
            if left <= 0:
                break
            room[owner] = left - 1
            out.setdefault(owner, []).append((seq, slot))
            seq += 1
        if seq == start:
            return
        if not out:
            self._append(gp, og, puller, [], seq)
            return
        for owner, items in out.items():
            self._append(gp, og, gp.consumer(owner), items, seq)
            if owner != puller.consumer_id:
                self.dispatched = True


class _SeqOf:
    """The consume-log sequence behind a pull-log offset of one consumer (its runs, in order)."""

    def __init__(self, cp: ConsumerProgress) -> None:
        self._runs = list(cp.runs)
        self._i = 0

    def __call__(self, poff: int) -> int:
        runs = self._runs
        i = self._i if self._i < len(runs) and runs[self._i][0] <= poff else 0
        while i < len(runs) and runs[i][0] + runs[i][2] <= poff:
            i += 1
        self._i = i
        first, seq, count = runs[i]
        assert first <= poff < first + count, f"pull-log offset {poff} is in no run of {self._runs[:3]}…"
        return seq + (poff - first)
