"""Who owns each order-key slot of an ordered consumer group, as pure state (docs/ordered.md).

For each (subject, consumer group) pulled with ``ordered``, the broker hands every message of a
slot to the one consumer that owns it. This module keeps who owns which slot, which slots are
moving and to whom, and which pull-log offsets each consumer was handed of each slot (to tell
when a slot is drained: every message of it the owner was handed is acknowledged). It does no
I/O; ``ordered_take`` reads the files and writes the pull logs.

Rules:

- a consumer is live while it pulled within the lease, or has a long poll parked; a state made
  after a start or a promotion counts every known consumer as seen then (``started_ms``);
- nothing is placed until the group's consumers stopped joining for ``SETTLE_QUIET_MS`` (at most
  ``SETTLE_MS`` after the state was made), so consumers that start together share the slots from
  the start, and a lone consumer does not wait long;
- a slot first seen goes to the live consumer owning fewest;
- when the live set changes, owners above ``ceil(slots / live)`` give slots to the least loaded:
  such a slot moves only once its owner acknowledged every message of it that a pull handed it,
  never while the owner may still be handling one. Meanwhile the owner's pulls *withhold* the
  slot's messages (skip them), and the move hands those to the new owner, in order, with those
  dispatched to the owner's pull log that no pull handed it yet;
- a slot whose owner is not live moves at once, with the owner's unacknowledged messages of it;
  a consumer that closed said so (``left``) and is not live from then on, until it pulls again.

Nothing here is persisted: after a restart the state is rebuilt from the pull logs (a consumer
holding unacknowledged messages of a slot owns it).
"""

from __future__ import annotations

import bisect
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from qmq.store.progress import ConsumerProgress, GroupProgress

DEFAULT_ORDERED_LEASE_MS = 20_000
# a group's state places no slot until no consumer joined it for SETTLE_QUIET_MS, or SETTLE_MS
# after it was made: consumers started together (or coming back after a restart or promotion) all
# register first, rather than one taking every slot and giving most back through moves, each
# waiting for it to drain; a group whose consumers are all there starts after the quiet time
SETTLE_MS = 1_000
SETTLE_QUIET_MS = 100
# unacknowledged messages a consumer of an ordered group is handed at most: the dispatch stops at
# the first message whose owner is full, so a slow consumer slows its group, not the broker's memory
ORDERED_UNACKED_MAX = 10_000


def is_acked(cp: ConsumerProgress, poff: int) -> bool:
    """Whether pull-log offset ``poff`` of ``cp`` is acknowledged."""
    if poff < cp.ack_offset:
        return True
    acked = cp.acked
    i = bisect.bisect_right(acked, [poff, float("inf")]) - 1
    return i >= 0 and acked[i][0] <= poff < acked[i][1]


@dataclass(slots=True)
class OrderedGroup:
    """The slot owners of one ordered consumer group on this broker."""

    started_ms: int
    owners: dict[int, str] = field(default_factory=dict)  # slot -> consumer id
    moving: dict[int, str] = field(default_factory=dict)  # slot -> consumer it goes to once drained
    # consumer id -> slot -> pull-log offsets handed (acknowledged ones pruned from the left)
    handed: dict[str, dict[int, deque[int]]] = field(default_factory=dict)
    # consumer id -> pull-log offset below which its pulls handed it everything not withheld (what
    # lies beyond was appended to its pull log but never handed: a move takes it along at once)
    sent: dict[str, int] = field(default_factory=dict)
    # consumer id -> slot -> pull-log offsets of a slot moving away that its pulls skipped: they go
    # to the slot's next owner when the move ends (or back to this consumer if it is called off)
    withheld: dict[str, dict[int, set[int]]] = field(default_factory=dict)
    cancelled: list[int] = field(default_factory=list)  # moves called off, their owner live
    live_ids: frozenset[str] = frozenset()
    placing: bool = False  # the settle is over: slots are placed (never settles again)
    joined: set[str] = field(default_factory=set)  # consumers that pulled while it settles
    joined_ms: int = 0  # when the last of them first pulled
    left: set[str] = field(default_factory=set)  # consumers that said they leave (closed), until they pull

    # -- settling -------------------------------------------------------------------------

    def settle_left_ms(self, consumer_id: str, now_ms: int) -> int:
        """How much longer nothing is placed (0: slots are placed from now on); ``consumer_id`` pulls."""
        if self.placing:
            return 0
        if consumer_id not in self.joined:
            self.joined.add(consumer_id)
            self.joined_ms = now_ms
        left = min(self.started_ms + SETTLE_MS, max(self.joined_ms, self.started_ms) + SETTLE_QUIET_MS) - now_ms
        if left > 0:
            return left
        self.placing = True
        self.joined.clear()
        return 0

    # -- liveness -----------------------------------------------------------------------

    def live(self, gp: GroupProgress, now_ms: int, lease_ms: int, puller: str) -> frozenset[str]:
        out = {puller}
        left = self.left
        for cid, cp in gp.consumers.items():
            if cid in left:
                continue
            if cp.parked > 0 or now_ms - max(cp.last_seen_ms, self.started_ms) < lease_ms:
                out.add(cid)
        return frozenset(out)

    # -- what a consumer holds ------------------------------------------------------------

    def hand(self, consumer_id: str, slot: int, poffs: Iterable[int]) -> None:
        by_slot = self.handed.setdefault(consumer_id, {})
        dq = by_slot.get(slot)
        if dq is None:
            dq = by_slot[slot] = deque()
        dq.extend(poffs)

    def holds(self, cp: ConsumerProgress, slot: int) -> bool:
        """Whether ``cp`` has unacknowledged messages of ``slot`` (pruning what it acknowledged)."""
        dq = self.handed.get(cp.consumer_id, {}).get(slot)
        if not dq:
            return False
        while dq and is_acked(cp, dq[0]):
            dq.popleft()
        if dq and any(not is_acked(cp, p) for p in dq):
            return True
        dq.clear()
        return False

    def holds_delivered(self, cp: ConsumerProgress, slot: int) -> bool:
        """Whether ``cp`` may be running a message of ``slot``: one a pull of it handed (not
        withheld) and that it did not acknowledge."""
        dq = self.handed.get(cp.consumer_id, {}).get(slot)
        if not dq:
            return False
        sent = self.sent.get(cp.consumer_id, 0)
        kept = self.withheld.get(cp.consumer_id, {}).get(slot, set())
        for p in dq:  # in pull-log order
            if p >= sent:
                return False
            if p not in kept and not is_acked(cp, p):
                return True
        return False

    def delivered(self, cp: ConsumerProgress) -> None:
        """A pull of ``cp`` handed it its pull log up to its cursor (never lowered: a new session
        hands again what an old one may still be running)."""
        if cp.cursor > self.sent.get(cp.consumer_id, 0):
            self.sent[cp.consumer_id] = cp.cursor

    def away(self, consumer_id: str) -> set[int]:
        """The slots moving away from ``consumer_id``: its pulls withhold their messages."""
        if not self.moving:
            return set()
        return {slot for slot in self.moving if self.owners.get(slot) == consumer_id}

    def withhold(self, consumer_id: str, slot: int, poff: int) -> None:
        self.withheld.setdefault(consumer_id, {}).setdefault(slot, set()).add(poff)

    def prune(self, cp: ConsumerProgress) -> None:
        """Drop what ``cp`` acknowledged from its handed offsets (bounded by what it holds)."""
        by_slot = self.handed.get(cp.consumer_id)
        if not by_slot:
            return
        for slot in [s for s, dq in by_slot.items() if not self.holds(cp, s)]:
            del by_slot[slot]

    def unacked_of(self, cp: ConsumerProgress) -> list[tuple[int, int]]:
        """``(pull-log offset, slot)`` of every unacknowledged message ``cp`` was handed, in order."""
        out: list[tuple[int, int]] = []
        for slot, dq in self.handed.get(cp.consumer_id, {}).items():
            out.extend((p, slot) for p in dq if not is_acked(cp, p))
        out.sort()
        return out

    # -- placing slots ------------------------------------------------------------------

    def load(self, live: frozenset[str]) -> Counter[str]:
        load: Counter[str] = Counter({c: 0 for c in live})
        for slot, owner in self.owners.items():
            target = self.moving.get(slot, owner)
            if target in live:
                load[target] += 1
        return load

    @staticmethod
    def least_loaded(load: Counter[str]) -> str:
        return min(load, key=lambda c: (load[c], c))

    def place_new(self, slot: int, live: frozenset[str], load: Counter[str]) -> str:
        owner = self.least_loaded(load)
        self.owners[slot] = owner
        load[owner] += 1
        return owner

    def orphaned(self, live: frozenset[str]) -> dict[str, list[int]]:
        """Slots whose owner is not live, by owner; moves to a consumer gone are called off."""
        for slot, target in list(self.moving.items()):
            if target not in live:
                del self.moving[slot]
                if self.owners.get(slot) in live:
                    self.cancelled.append(slot)
        out: dict[str, list[int]] = {}
        for slot, owner in self.owners.items():
            if owner not in live:
                out.setdefault(owner, []).append(slot)
        return out

    def balance(self, live: frozenset[str]) -> None:
        """Owners above their share give slots (as moves) to the least loaded live consumers."""
        if not live or not self.owners:
            return
        cap = -(-len(self.owners) // len(live))
        load = self.load(live)
        excess: list[int] = []
        for slot in sorted(self.owners):
            holder = self.moving.get(slot, self.owners[slot])
            if load[holder] > cap:
                load[holder] -= 1
                excess.append(slot)
        for slot in excess:
            target = self.least_loaded(load)
            load[target] += 1
            if target == self.owners[slot]:
                if self.moving.pop(slot, None) is not None:
                    self.cancelled.append(slot)
            else:
                self.moving[slot] = target

    def ready_moves(self, gp: GroupProgress) -> list[tuple[int, ConsumerProgress | None, str]]:
        """``(slot, owner, target)`` of each move whose owner runs no message of the slot any more."""
        out: list[tuple[int, ConsumerProgress | None, str]] = []
        for slot, target in self.moving.items():
            owner = self.owners.get(slot)
            cp = gp.consumers.get(owner) if owner is not None else None
            if cp is None or not self.holds_delivered(cp, slot):
                out.append((slot, cp, target))
        return out
