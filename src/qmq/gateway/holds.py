"""Holds taken again on a new master: a broker keeps the holds of a gateway's receipts (SETTLE
``hold``: give back at the deadline unless settled) in memory only, so when its group's master
fails over to the slave they are gone. The slave has the pull logs (a pull is answered once its
action reached the slave), not the timers.

Every sweep of the receipts (``qmq.gateway.receipts``) asks whether a broker group this gateway
holds receipts on has another master than when its holds were taken: another address (the meta
server names the promoted slave), or the same address over another connection (the gateway's
connection to it was lost: the master restarted in place, or the network cut it, and its holds
may be gone). If so, the gateway sends the master the holds of every receipt it still keeps
there, for what is left of each one's ack timeout; taking a hold a live broker still has again
only moves its deadline to the same moment, rounded up. The messages then come back at
their deadlines, exactly once (the broker decides between an ack and the give-back), and an ack
before the deadline is honoured by the new master like any. Receipts past their deadline meanwhile
are given back by the gateway's own sweeper, as for a broker that did not take a hold.
"""

from __future__ import annotations

import asyncio
import logging
from collections import defaultdict
from typing import Final

from qmq.gateway.receipts import Held, Issued, Receipt
from qmq.gateway.settle import Settler

log = logging.getLogger(__name__)

# SETTLE hold requests one check sends at most (one per pull still out); the rest wait for the next
REHOLDS_MAX: Final = 1_000
# the shortest hold worth asking for: a deadline closer than this is the sweeper's
HOLD_MS_MIN: Final = 50


class HoldKeeper:
    def __init__(self, settler: Settler, issued: Issued) -> None:
        self.settler = settler
        self.issued = issued
        self.reheld = 0

    async def check(self) -> None:
        """Take the holds again on every broker group whose master changed or was reconnected."""
        held_at = self.settler.held_at  # broker group -> (master's address, connection) when holds were taken
        for name, (address, incarnation) in list(held_at.items()):
            bg = self.settler.meta.groups.get(name)
            if bg is None:
                continue  # between masters (no master listed)
            if bg.address == address:
                conn = self.settler.pool.get(address)
                if conn.connected and conn.incarnations == incarnation:
                    continue  # the same master over the same connection: its holds are there
            helds = self.issued.broker_held_in(name)
            if not helds or await self._hold_again(name, helds):
                held_at[name] = (bg.address, self.settler.pool.get(bg.address).incarnations)

    async def _hold_again(self, name: str, helds: list[Held]) -> bool:
        now = asyncio.get_running_loop().time()
        by_pull: dict[tuple[tuple[str, str, str, str], int], list[Receipt]] = defaultdict(list)
        for h in helds:
            left_ms = int((h.deadline - now) * 1000)
            if left_ms >= HOLD_MS_MIN:  # rounded up: a message may come back a little late, never early
                by_pull[(h.receipt.lane, (left_ms + 99) // 100 * 100)].append(h.receipt)
        pulls = list(by_pull.items())[:REHOLDS_MAX]
        answers = await asyncio.gather(
            *(self.settler.each_lane(receipts, "hold", {"hold_ms": left_ms}) for (_lane, left_ms), receipts in pulls)
        )
        # an exception: the new master could not be asked, or does not know it is master yet (tried
        # again at the next sweep); held false: it did not take the hold (its HOLDS_MAX), which this
        # gateway's own give-back after the deadline covers
        failed = [a for by_lane in answers for a in by_lane.values() if isinstance(a, BaseException)]
        if failed:
            log.info(
                "broker group %s: new or reconnected master; %d hold(s) not taken again there yet (%s): tried again",
                name,
                len(failed),
                failed[0],
            )
            return False
        taken = sum(len(r) for _k, r in pulls)
        self.reheld += taken
        log.info(
            "broker group %s has a new or reconnected master: the holds of %d receipt(s) taken there again", name, taken
        )
        return len(pulls) == len(by_pull)
