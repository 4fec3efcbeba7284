"""SETTLE: acks, give-backs and held positions of one consumer's pull log, for receipts that
any HTTP gateway of a cluster settles (docs/gateway.md, docs/protocol.md).

A gateway hands out a pulled message under a receipt naming the broker group, subject,
consumer group, consumer id and pull-log position. Whichever gateway the receipt comes back
to settles it here, so the broker decides each race in one place:

- ``ack`` ranges: acknowledged; the answer lists the positions that were settled already
  (``settled``: acked, or given back) and, of those, the ones this master remembers giving
  back (``given_back_before``: their ack timeout passed, or a nack), so a gateway never
  answers "acked" for a message that comes back.
- ``give_back`` ranges: the positions among them not yet settled go to the group's retry
  subject at once with ``times`` one higher (``move_to_retry``), and are acked, in one step;
  the answer's ``settled`` lists those of them settled already, as for ``ack``.
- ``hold`` ranges with ``hold_ms``: given back that long from now unless settled by then, on
  this master's timer. The timer is memory only, bounded by ``HOLDS_MAX``: a broker restart or
  failover forgets it, and the gateway that issued the receipts gives them back itself; a
  gateway killed meanwhile leaves them to ``consumer_offline_ms``.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import logging
from collections import OrderedDict
from typing import Final, Protocol

from qmq.common.clock import Clock
from qmq.common.naming import retry_subject
from qmq.serving.group_commit import GroupCommit
from qmq.serving.requests import BadRequest
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import StoreError
from qmq.store.progress import ConsumerProgress, GroupProgress
from qmq.store.redelivery import base_of, move_to_retry

log = logging.getLogger(__name__)

# Held entries (one per SETTLE with ``hold``: a pull's positions) a master keeps at once; past
# it a hold is answered ``held: false`` and the gateway's own timer gives them back.
HOLDS_MAX: Final = 100_000
# Positions one SETTLE may name, over all its ranges.
SETTLE_POSITIONS_MAX: Final = 10_000
# The longest hold: the gateway's longest ack timeout.
HOLD_MS_MAX: Final = 600_000
# Positions given back that a master remembers (the oldest forgotten first), so that an ack coming
# after its message was given back is answered as such.
GIVEN_BACK_REMEMBERED_MAX: Final = 200_000


class SettleContext(Protocol):
    @property
    def role(self) -> str: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def store(self) -> BrokerStore: ...
    @property
    def flusher(self) -> GroupCommit: ...


class OnMoved(Protocol):
    """Called with the retry subjects a give-back stored messages on (to make them visible)."""

    def __call__(self, subjects: set[str], /) -> None: ...


def normalized(ranges: list[list[int]]) -> list[list[int]]:
    """``ranges`` sorted and merged; BadRequest past ``SETTLE_POSITIONS_MAX`` positions."""
    out: list[list[int]] = []
    for start, end in sorted(ranges):
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    total = sum(e - s for s, e in out)
    if total > SETTLE_POSITIONS_MAX:
        raise BadRequest(f"the ranges name {total} positions; at most {SETTLE_POSITIONS_MAX} a request")
    return out


def settled_positions(cp: ConsumerProgress, ranges: list[list[int]]) -> list[int]:
    """The positions of ``ranges`` (normalized) that ``cp`` acked already, or never pulled."""
    out: list[int] = []
    acked = cp.acked
    ai = 0
    for start, end in ranges:
        for p in range(start, end):
            if p < cp.ack_offset or p >= cp.pull_log_end:
                out.append(p)
                continue
            while ai < len(acked) and acked[ai][1] <= p:
                ai += 1
            if ai < len(acked) and acked[ai][0] <= p:
                out.append(p)
    return out


class GivenBack:
    """The positions given back lately, per (subject, group, consumer id): memory only, bounded."""

    def __init__(self, remembered_max: int = GIVEN_BACK_REMEMBERED_MAX) -> None:
        self.remembered_max = remembered_max
        self._positions: OrderedDict[tuple[str, str, str, int], None] = OrderedDict()

    def add(self, gp: GroupProgress, consumer_id: str, positions: list[int]) -> None:
        for p in positions:
            self._positions[(gp.subject, gp.group, consumer_id, p)] = None
        while len(self._positions) > self.remembered_max:
            self._positions.popitem(last=False)

    def among(self, gp: GroupProgress, consumer_id: str, positions: list[int]) -> list[int]:
        return [p for p in positions if (gp.subject, gp.group, consumer_id, p) in self._positions]


def give_back(
    store: BrokerStore, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]], given: GivenBack
) -> int:
    """Move the unsettled positions of ``ranges`` (normalized) to retry and ack them; how many moved."""
    settled = set(settled_positions(cp, ranges))
    unsettled = [p for start, end in ranges for p in range(start, end) if p not in settled]
    if not unsettled:
        return 0
    moved = 0
    while True:  # move_to_retry moves a bounded batch at a time
        n = move_to_retry(store, gp, cp, gp.max_retries, only=ranges)
        moved += n
        if n == 0:
            break
    given.add(gp, cp.consumer_id, unsettled)
    return moved


def retry_of(gp: GroupProgress) -> str:
    return retry_subject(*base_of(gp.subject, gp.group))


class HeldPositions:
    """The master's timer of held positions: each entry is given back at its due time (broker
    clock) unless settled by then. Entries of a consumer or group the broker forgot are dropped."""

    def __init__(self, broker: SettleContext, on_moved: OnMoved) -> None:
        self.broker = broker
        self.on_moved = on_moved
        self._heap: list[tuple[int, int, str, str, str, list[list[int]]]] = []
        self._order = itertools.count()
        self._handle: asyncio.TimerHandle | None = None
        self._at_ms: int | None = None
        self.given_back_total = 0
        self.given = GivenBack()

    def __len__(self) -> int:
        return len(self._heap)

    def hold(self, gp: GroupProgress, consumer_id: str, ranges: list[list[int]], due_ms: int) -> bool:
        if len(self._heap) >= HOLDS_MAX:
            return False
        heapq.heappush(self._heap, (due_ms, next(self._order), gp.subject, gp.group, consumer_id, ranges))
        self._schedule()
        return True

    def _schedule(self) -> None:
        if not self._heap:
            return
        due = self._heap[0][0]
        if self._at_ms is not None and self._at_ms <= due:
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at_ms = due
        wait_ms = max(0, due - self.broker.clock.now_ms())
        self._handle = asyncio.get_running_loop().call_later(wait_ms / 1000, self._fire)

    def _fire(self) -> None:
        self._handle = None
        self._at_ms = None
        broker = self.broker
        if broker.stopping:
            return
        if broker.role != "master":
            self._heap.clear()  # a slave moves nothing; the gateways give back what they issued
            return
        now = broker.clock.now_ms()
        store = broker.store
        moved_to: set[str] = set()
        done = 0
        while self._heap and self._heap[0][0] <= now and done < 1_000:
            _due, _n, subject, group, consumer_id, ranges = heapq.heappop(self._heap)
            done += 1
            gp = store.progress.get(subject, group)
            cp = gp.consumers.get(consumer_id) if gp is not None else None
            if gp is None or cp is None:
                continue
            try:
                n = give_back(store, gp, cp, ranges, self.given)
            except StoreError as exc:
                log.error("held positions could not be given back (%s); the gateways give them back", exc)
                continue
            except Exception:  # one entry's trouble never stops the others
                log.exception("giving back held positions of %r / %r (%s) failed", subject, group, consumer_id)
                continue
            if n:
                self.given_back_total += n
                moved_to.add(retry_of(gp))
                log.info(
                    "%d message(s) of %r pulled by %r (group %s) not settled within their ack timeout: to retry",
                    n,
                    subject,
                    consumer_id,
                    group,
                )
        if moved_to:
            self.on_moved(moved_to)
        self._schedule()
