"""A steady send and consume load against a running cluster, for tests and benches of operations
that must not interrupt it (a drain, a rolling restart): open-loop senders, as a service taking
requests has (a new send does not wait for earlier ones, up to ``outstanding_max`` each), and one
consumer group taking and acknowledging everything.

It records what an operator's promise is checked against: every send acknowledged (and when),
every send failed, the messages in flight at most, and every message the consumer group got.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
from dataclasses import dataclass, field
from datetime import timedelta

from qmq.aio import Producer, PullConsumer
from qmq.common.errors import QmqError


@dataclass
class LoadRecord:
    """What a load saw: acknowledged sends (id -> loop time), failures, the peak in flight, receipts."""

    acked: dict[str, float] = field(default_factory=dict)
    failed: list[str] = field(default_factory=list)
    received: set[str] = field(default_factory=set)
    in_flight: int = 0
    in_flight_max: int = 0

    def largest_gap_s(self, start: float, end: float) -> float:
        """The longest time within [start, end] without a send acknowledged."""
        times = sorted(t for t in self.acked.values() if start <= t <= end)
        edges = [start, *times, end]
        return max(b - a for a, b in itertools.pairwise(edges))


class Load:
    """``senders`` open-loop senders of ``subject`` and one consumer group taking it."""

    def __init__(
        self,
        producer: Producer,
        pull: PullConsumer,
        subject: str,
        *,
        senders: int = 4,
        send_every_s: float = 0.002,
        outstanding_max: int = 1_000,
        body_bytes: int = 100,
        delay_ms: int = 0,
    ) -> None:
        """``delay_ms``: every message is due this long after its send (through a delay group)."""
        self.producer = producer
        self.pull = pull
        self.subject = subject
        self.senders = senders
        self.send_every_s = send_every_s
        self.outstanding_max = outstanding_max
        self.body = b"x" * body_bytes
        self.delay = timedelta(milliseconds=delay_ms) if delay_ms else None
        self.record = LoadRecord()
        self._stop_sending = asyncio.Event()
        self._stop_taking = asyncio.Event()
        self._caught_up = asyncio.Event()
        self._acked_enough = asyncio.Event()
        self._acked_target = 0
        self._tasks: list[asyncio.Task[None]] = []
        self._taker: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._tasks = [asyncio.ensure_future(self._send()) for _ in range(self.senders)]
        self._taker = asyncio.ensure_future(self._take())

    def _settled(self, message_id: str, fut: asyncio.Future[None]) -> None:
        r = self.record
        r.in_flight -= 1
        if fut.cancelled() or fut.exception() is not None:
            r.failed.append(str(fut.exception()) if not fut.cancelled() else "cancelled")
            return
        r.acked[message_id] = asyncio.get_running_loop().time()
        if len(r.acked) >= self._acked_target:
            self._acked_enough.set()

    async def _send(self) -> None:
        outstanding: set[asyncio.Future[None]] = set()
        r = self.record
        while not self._stop_sending.is_set():
            m = self.producer.generate_message(self.subject)
            m.body = self.body
            if self.delay is not None:
                m.set_delay(self.delay)
            fut = self.producer.send_nowait(m)
            r.in_flight += 1
            r.in_flight_max = max(r.in_flight_max, r.in_flight)
            fut.add_done_callback(functools.partial(self._settled, m.message_id))
            outstanding.add(fut)
            fut.add_done_callback(outstanding.discard)
            if len(outstanding) >= self.outstanding_max:
                await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
            else:
                await asyncio.sleep(self.send_every_s)  # the load's pace
        await asyncio.gather(*outstanding, return_exceptions=True)

    async def _take(self) -> None:
        while not self._stop_taking.is_set():
            try:
                batch = await self.pull.pull(max_messages=500, timeout_ms=200)
            except QmqError:
                await asyncio.sleep(0.1)  # a group between masters: ask again shortly
                continue
            batch.ack_all()
            self.record.received.update(m.message_id for m in batch)
            self._check_caught_up()

    def _check_caught_up(self) -> None:
        # Only once every sender has ended, each after settling its sends: a send in flight when
        # sending stops is acknowledged later, and the taker must wait for it too.
        senders_done = bool(self._tasks) and all(t.done() for t in self._tasks)
        if senders_done and self.record.acked.keys() <= self.record.received:
            self._caught_up.set()

    async def until_acked(self, n: int, timeout_s: float = 60.0) -> None:
        """Wait until ``n`` sends in all were acknowledged; TimeoutError after ``timeout_s``."""
        self._acked_target = n
        if len(self.record.acked) >= n:
            return
        self._acked_enough.clear()
        await asyncio.wait_for(self._acked_enough.wait(), timeout_s)

    async def stop(self, timeout_s: float = 60.0) -> None:
        """Stop sending, then take until every acknowledged message came (or ``timeout_s``)."""
        self._stop_sending.set()
        await asyncio.gather(*self._tasks)
        self._check_caught_up()
        with contextlib.suppress(TimeoutError):  # the caller compares acked and received
            await asyncio.wait_for(self._caught_up.wait(), timeout_s)
        self._stop_taking.set()
        if self._taker is not None:
            await self._taker
