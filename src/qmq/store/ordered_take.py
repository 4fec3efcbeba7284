"""Pulls of ordered consumer groups: each slot's messages go to its owner only (docs/ordered.md).

A pull of an ordered group does not hand the puller the next range of the subject. It
*dispatches*: the entries after the group's pull offset are appended, in order, to the pull log
of their slot's owner (``slots.OrderedGroup``) as ordinary PULL actions, and the puller is then
handed what its own pull log holds that it has not received (the same path that re-delivers
after a reconnect). Consumers that were handed messages by another's pull get them on their next
pull; a long poll parked meanwhile is woken by the broker (``dispatched``).

A slot moving away from its owner (slots.py) is still dispatched to the owner, whose pulls
withhold its messages (skip them, never handed); once the owner acknowledged what it was handed
of the slot, the withheld messages go to the new owner, in order. So a move pauses only its own
slot. A dispatch stops at the first entry whose owner already holds ``ORDERED_UNACKED_MAX``
unacknowledged messages; it scans at most ``_SCAN_ENTRIES_MAX`` entries. Entries without an order key go to the
puller. A slot whose owner's lease ran out moves with the owner's unacknowledged messages of it,
appended to the new owner's pull log before anything newer and acknowledged for the old owner.
Nothing is dispatched while a group's state on this broker settles (``slots.SETTLE_QUIET_MS``).
"""

from __future__ import annotations

from qmq.store.action_log import ProgressLog
from qmq.store.consume_log import ENTRY
from qmq.store.message_log import MessageLog
from qmq.store.progress import ConsumerProgress, GroupProgress
from qmq.store.slots import ORDERED_UNACKED_MAX, OrderedGroup, is_acked
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
        self.settling_ms = 0  # the last dispatch placed nothing: the group's state settles this much longer

    def dispatch(self, st: SubjectState, gp: GroupProgress, puller: ConsumerProgress, now_ms: int) -> None:
        """Bring slot ownership up to date and append the next entries to their owners' pull logs."""
        self.dispatched = False
        self.settling_ms = 0
        og = self.groups.get((gp.subject, gp.group))
        if og is None:
            og = self.groups[(gp.subject, gp.group)] = self._rebuild(st, gp, now_ms)
        for cid in [c for c in og.handed if c not in gp.consumers]:
            del og.handed[cid]  # forgotten (nothing unacknowledged): a new pull log starts at 0
        for cid in [c for c in og.sent if c not in gp.consumers]:
            del og.sent[cid]
        if og.left:
            og.left.discard(puller.consumer_id)  # it pulls again: back in the group
            og.left.intersection_update(gp.consumers)
        og.prune(puller)
        settle_ms = og.settle_left_ms(puller.consumer_id, now_ms)
        if settle_ms:
            self.settling_ms = settle_ms
            return  # let the group's consumers register before slots are placed (slots.SETTLE_MS)
        live = og.live(gp, now_ms, self.lease_ms, puller.consumer_id)
        orphaned = og.orphaned(live)
        gone = [cid for cid, cp in gp.consumers.items() if cid not in live and cp.unacked > 0]
        for owner in sorted(set(orphaned) | set(gone)):
            self._take_over(st, gp, og, owner, orphaned.get(owner, []), live, puller)
        if live != og.live_ids:
            og.live_ids = live
            og.balance(live)
        self._call_off(st, gp, og)
        self._finish_moves(st, gp, og)
        self._dispatch(st, gp, og, puller, live)

    def leave(self, st: SubjectState | None, gp: GroupProgress, cp: ConsumerProgress, now_ms: int) -> None:
        """``cp`` closed (its handlers ended, its last acks sent): it counts as gone from now, so the
        next pull of the group moves its slots, with what it left unacknowledged, to the live
        consumers; a pull of its own brings it back."""
        og = self.groups.get((gp.subject, gp.group))
        if og is None:
            if st is None or not gp.ordered:
                return  # no slot of this group was ever placed here
            og = self.groups[(gp.subject, gp.group)] = self._rebuild(st, gp, now_ms)
        og.left.add(cp.consumer_id)

    def away(self, gp: GroupProgress, cp: ConsumerProgress) -> set[int]:
        """Slots moving away from ``cp``, whose messages its pulls withhold (``withhold``)."""
        og = self.groups.get((gp.subject, gp.group))
        return og.away(cp.consumer_id) if og is not None else set()

    def withhold(self, gp: GroupProgress, cp: ConsumerProgress, slot: int, poff: int) -> None:
        og = self.groups.get((gp.subject, gp.group))
        if og is not None:
            og.withhold(cp.consumer_id, slot, poff)

    def delivered(self, gp: GroupProgress, cp: ConsumerProgress) -> None:
        """A pull handed ``cp`` its pull log up to its cursor: those messages may run from now on."""
        og = self.groups.get((gp.subject, gp.group))
        if og is not None:
            og.delivered(cp)

    def _finish_moves(self, st: SubjectState, gp: GroupProgress, og: OrderedGroup) -> None:
        """End each move whose owner runs no message of the slot: what it holds of the slot
        (withheld, or not handed yet) goes to the new owner, in order, before anything newer."""
        for slot, cp, target in og.ready_moves(gp):
            if cp is not None:
                self._transfer(st, gp, og, cp, gp.consumer(target), slot)
            og.owners[slot] = target
            del og.moving[slot]

    def _call_off(self, st: SubjectState, gp: GroupProgress, og: OrderedGroup) -> None:
        """Moves called off: what the owner withheld of the slot goes back to it, in order."""
        for slot in og.cancelled:
            owner = og.owners.get(slot)
            cp = gp.consumers.get(owner) if owner is not None else None
            if cp is not None and slot not in og.moving:
                self._transfer(st, gp, og, cp, cp, slot)
        og.cancelled.clear()

    def _transfer(
        self,
        st: SubjectState,
        gp: GroupProgress,
        og: OrderedGroup,
        src: ConsumerProgress,
        dst: ConsumerProgress,
        slot: int,
    ) -> None:
        """Append ``src``'s unacknowledged messages of ``slot`` to ``dst``'s pull log, in order, and
        acknowledge them for ``src`` (``dst`` may be ``src``: handed again, as new entries)."""
        og.withheld.get(src.consumer_id, {}).pop(slot, None)
        dq = og.handed.get(src.consumer_id, {}).pop(slot, None)
        poffs = sorted(p for p in (dq or ()) if not is_acked(src, p))
        if not poffs:
            return
        items = [(seq, slot) for seq in _seqs_of(src, poffs)]
        acks: list[list[int]] = []
        for p in poffs:
            if acks and acks[-1][1] == p:
                acks[-1][1] += 1
            else:
                acks.append([p, p + 1])
        self._append(gp, og, dst, items, gp.pull_offset)
        self.progress.ack(gp, src, acks)
        self.dispatched = True

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
            og.sent[cp.consumer_id] = cp.pull_log_end  # all it holds may be running
            for slot in og.handed.get(cp.consumer_id, {}):
                og.owners.setdefault(slot, cp.consumer_id)
            # what a withholding before this state skipped must be handed again: everything
            # unacknowledged is (a repeat at worst, in order)
            cp.cursor = cp.ack_offset
        return og

    def _take_over(
        self,
        st: SubjectState,
        gp: GroupProgress,
        og: OrderedGroup,
        owner: str,
        slots: list[int],
        live: frozenset[str],
        puller: ConsumerProgress,
    ) -> None:
        """Move the slots of ``owner`` (its lease ran out) with every message it holds unacknowledged:
        each to its slot's new owner (one without an order key to the puller), in pull-log order."""
        load = og.load(live)
        for slot in slots:
            og.moving.pop(slot, None)
            target = og.least_loaded(load)
            load[target] += 1
            og.owners[slot] = target
        og.handed.pop(owner, None)
        og.withheld.pop(owner, None)
        old = gp.consumers.get(owner)
        if old is None or not old.unacked:
            return
        by_target: dict[str, list[tuple[int, int]]] = {}
        acks: list[list[int]] = []
        for poff, seq, count in list(old.runs):
            raw = st.clog.read(seq, count)
            for i, (_off, _size, _ms, _bloom, order_slot) in enumerate(ENTRY.iter_unpack(raw)):
                if is_acked(old, poff + i):
                    continue
                slot = order_slot - 1 if order_slot else -1
                if slot >= 0 and og.owners.get(slot) not in live:
                    og.place_new(slot, live, load)
                target = og.owners[slot] if slot >= 0 else puller.consumer_id
                by_target.setdefault(target, []).append((seq + i, slot))
                if acks and acks[-1][1] == poff + i:
                    acks[-1][1] += 1
                else:
                    acks.append([poff + i, poff + i + 1])
        for target, items in by_target.items():
            self._append(gp, og, gp.consumer(target), items, gp.pull_offset)
        if acks:
            self.progress.ack(gp, old, acks)
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
        n = min(_SCAN_ENTRIES_MAX, st.next_seq - start)  # written: answers wait for their flush (take.py)
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
                slot = order_slot - 1  # a moving slot's go to its owner still, which withholds them
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


def _seqs_of(cp: ConsumerProgress, poffs: list[int]) -> list[int]:
    """The consume-log sequences behind sorted pull-log offsets of ``cp`` (its runs, in order)."""
    out: list[int] = []
    runs = cp.runs
    i = 0
    for p in poffs:
        while i < len(runs) and runs[i][0] + runs[i][2] <= p:
            i += 1
        first, seq, count = runs[i]
        assert first <= p < first + count, f"pull-log offset {p} of {cp.consumer_id!r} is in no run"
        out.append(seq + (p - first))
    return out
