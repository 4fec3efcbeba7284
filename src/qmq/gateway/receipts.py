"""Receipts: the messages a gateway handed out over HTTP and holds until they are acked, nacked
or their ack timeout passes (a visibility timeout).

HTTP clients keep no session, so a pulled message is held under a deadline: the sweeper gives
one whose deadline passed back to its consumer group as a failed attempt (``nack`` with no
back-off: it comes again at once, to any consumer of the group, with ``times`` one higher, and
after the group's ``max_retries`` to the dead letters). Nothing pulled is stranded: a message
whose give-back fails (no broker just then) stays held and is tried again shortly; a gateway that
dies leaves its unacked messages to the broker, which sends them to retry once it sees the
consumer silent (``consumer_offline_ms``).

What became of a receipt is remembered for a while (a bounded table), so a client that repeats
an ack whose answer it lost is told ``acked`` rather than ``unknown``.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import secrets
from collections import OrderedDict
from dataclasses import dataclass
from typing import Final, Literal

from qmq.aio import ReceivedMessage
from qmq.common.errors import NeedRetry

log = logging.getLogger(__name__)

Outcome = Literal["acked", "nacked", "expired"]
# How often the sweeper looks for passed deadlines: a message comes back at most this late
# (ack timeouts are at least 1 s).
SWEEP_INTERVAL_MS: Final = 100
# A give-back that failed is tried again this much later.
GIVE_BACK_RETRY_MS: Final = 1_000
# Give-backs running at once (each is a send to the retry subject).
GIVE_BACKS_AT_ONCE_MAX: Final = 256


@dataclass(slots=True)
class Held:
    """A pulled message held under its receipt until ``deadline`` (event-loop time, seconds)."""

    message: ReceivedMessage
    group: str
    deadline: float
    ack_timeout_ms: int


class Receipts:
    """The held messages of one gateway; also its background service that gives back the expired."""

    def __init__(self, receipts_max: int) -> None:
        self.receipts_max = receipts_max
        # receipts of this process start with a random prefix: another gateway's are never ours
        self.prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)
        self._held: dict[str, Held] = {}
        self._deadlines: list[tuple[float, str]] = []  # a heap; entries of settled receipts are skipped
        self._outcomes: OrderedDict[str, Outcome] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self.expired = 0

    @property
    def held(self) -> int:
        return len(self._held)

    def room(self) -> int:
        return max(0, self.receipts_max - len(self._held))

    def hold(self, message: ReceivedMessage, group: str, ack_timeout_ms: int) -> str:
        receipt = f"{self.prefix}.{next(self._counter):x}"
        deadline = asyncio.get_running_loop().time() + ack_timeout_ms / 1000
        self._held[receipt] = Held(message, group, deadline, ack_timeout_ms)
        heapq.heappush(self._deadlines, (deadline, receipt))
        return receipt

    def take(self, receipt: str) -> Held | None:
        """The message held under ``receipt``, no longer held; None when it is not."""
        return self._held.pop(receipt, None)

    def put_back(self, receipt: str, held: Held, delay_ms: int) -> None:
        """Hold ``held`` again (its settling failed), to be given back after ``delay_ms``."""
        held.deadline = asyncio.get_running_loop().time() + delay_ms / 1000
        self._held[receipt] = held
        heapq.heappush(self._deadlines, (held.deadline, receipt))

    def settled(self, receipt: str, outcome: Outcome) -> None:
        self._outcomes[receipt] = outcome
        self._outcomes.move_to_end(receipt)
        while len(self._outcomes) > self.receipts_max:
            self._outcomes.popitem(last=False)

    def outcome(self, receipt: str) -> Outcome | None:
        """What became of a receipt no longer held, when still remembered."""
        return self._outcomes.get(receipt)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_loop(), name="receipt-sweeper")

    async def stop(self) -> None:
        """Stop sweeping and give back every message still held: the gateway is going away."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        await self.give_back(list(self._held), "the gateway that held it stopped")

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_MS / 1000)  # the sweep period, not a readiness wait
            try:
                await self.give_back(self._due(), "")
            except Exception:  # a bug must not stop the sweeps
                log.exception("giving back expired messages failed")

    def _due(self) -> list[str]:
        now = asyncio.get_running_loop().time()
        due: list[str] = []
        heap = self._deadlines
        while heap and heap[0][0] <= now and len(due) < GIVE_BACKS_AT_ONCE_MAX:
            deadline, receipt = heapq.heappop(heap)
            held = self._held.get(receipt)
            if held is not None and held.deadline == deadline:
                due.append(receipt)
        return due

    async def give_back(self, receipts: list[str], why: str) -> None:
        """Fail each message held under ``receipts`` back to its group at once (``times`` + 1)."""
        for start in range(0, len(receipts), GIVE_BACKS_AT_ONCE_MAX):
            chunk = [(r, h) for r in receipts[start : start + GIVE_BACKS_AT_ONCE_MAX] if (h := self.take(r))]
            results = await asyncio.gather(
                *(h.message.nack(NeedRetry(after=0, reason=why or _expired(h))) for _r, h in chunk),
                return_exceptions=True,
            )
            for (receipt, held), result in zip(chunk, results, strict=True):
                if isinstance(result, BaseException):
                    log.warning(
                        "giving back message %s of %r (group %s) failed, trying again in %d ms: %s",
                        held.message.printable_id,
                        held.message.subject,
                        held.group,
                        GIVE_BACK_RETRY_MS,
                        result,
                    )
                    self.put_back(receipt, held, GIVE_BACK_RETRY_MS)
                else:
                    self.expired += 1
                    self.settled(receipt, "expired")


def _expired(held: Held) -> str:
    return f"not acknowledged within ack_timeout_ms={held.ack_timeout_ms} of its pull through the HTTP gateway"
