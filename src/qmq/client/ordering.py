"""Send order per order key: at most one message of a key with the sender at a time.

The next message of a key is handed to the sender (on the single-group route of its slot's
broker group) only once the broker answered for the one before, so retries and reconnects
never let a later message of the key pass an earlier one. Keys do not wait for one another.
A message that fails fails the messages of its key queued behind it, rather than have them
stored out of order.

Messages waiting behind their key count against the send buffer's bound on messages, so a
producer that outruns the brokers meets ``BufferFullError`` here as anywhere.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from qmq.client.accumulator import MESSAGE_ID, WAITER, Entry, RouteKey, Waiter
from qmq.common.errors import BufferFullError, QmqError, SendError
from qmq.common.ordering import OrderMode, group_of_slot

log = logging.getLogger(__name__)


class OrderedRoutes(Protocol):
    """What ordered sends ask of the routing (qmq.client.meta.MetaClient)."""

    def route(self, subject: str) -> tuple[str, ...] | None: ...
    async def resolve(self, subject: str) -> tuple[str, ...]: ...
    def target(self, name: str) -> object | None: ...


@dataclass(slots=True)
class _Pending:
    subject: str
    slot: int
    order: OrderMode
    entry: Entry  # its waiter is the caller's


def place(slot: int, route: tuple[str, ...], order: OrderMode, available: Callable[[str], bool]) -> str | None:
    """The broker group a message of ``slot`` goes to: its slot's group, or with ``best_effort``
    the next available group of the (sorted) route when that one is not available."""
    if not route:
        return None
    home = group_of_slot(slot, route)
    if order == "strict" or available(home):
        return home
    groups = sorted(route)
    start = groups.index(home)
    for i in range(1, len(groups)):
        g = groups[(start + i) % len(groups)]
        if available(g):
            return g
    return home


class OrderedSends:
    """The chains of one producer's ordered messages, one per order key."""

    def __init__(
        self,
        routes: OrderedRoutes,
        submit: Callable[[RouteKey, Entry], None],
        loop: asyncio.AbstractEventLoop,
        waiting_max: int,
    ) -> None:
        self._routes = routes
        self._submit_entry = submit
        self._loop = loop
        self.waiting_max = waiting_max
        self._chains: dict[str, deque[_Pending]] = {}  # key -> messages queued behind the one out
        self.waiting = 0
        self._idle: list[asyncio.Future[None]] = []
        self._lookups: set[asyncio.Task[None]] = set()

    @property
    def keys_out(self) -> int:
        """Keys with a message at the sender now."""
        return len(self._chains)

    def enqueue(self, subject: str, key: str, slot: int, order: OrderMode, entry: Entry) -> None:
        """Send ``entry`` once the key's earlier messages are answered; BufferFullError when too
        many messages wait behind their keys."""
        pending = _Pending(subject, slot, order, entry)
        chain = self._chains.get(key)
        if chain is None:
            self._chains[key] = deque()
            self._send(key, pending)
            return
        if self.waiting >= self.waiting_max:
            raise BufferFullError(
                f"{self.waiting} ordered messages already wait behind earlier messages of their keys "
                f"(the limit is buffer_messages_max={self.waiting_max}); await send(), or slow down",
                entry[MESSAGE_ID],
            )
        chain.append(pending)
        self.waiting += 1

    def _send(self, key: str, p: _Pending) -> None:
        inner: asyncio.Future[None] = self._loop.create_future()
        inner.add_done_callback(lambda f: self._answered(key, p, f))
        entry: Entry = (p.entry[0], inner, p.entry[2], self._loop.time(), p.entry[4], p.entry[5])
        route = self._routes.route(p.subject)
        if route is None:
            task = asyncio.ensure_future(self._look_up_then_submit(p, entry))
            self._lookups.add(task)
            task.add_done_callback(self._lookups.discard)
            return
        self._submit(p, route, entry)

    async def _look_up_then_submit(self, p: _Pending, entry: Entry) -> None:
        try:
            route = await self._routes.resolve(p.subject)
        except QmqError as exc:
            _fail(entry[WAITER], SendError(f"looking up the route of {p.subject!r} failed: {exc}", entry[MESSAGE_ID]))
            return
        self._submit(p, route, entry)

    def _submit(self, p: _Pending, route: tuple[str, ...], entry: Entry) -> None:
        group = place(p.slot, route, p.order, lambda g: self._routes.target(g) is not None)
        if group is None:
            _fail(
                entry[WAITER],
                SendError(f"subject {p.subject!r} has no broker group yet; start a broker", entry[MESSAGE_ID]),
            )
            return
        try:
            self._submit_entry((group,), entry)
        except QmqError as exc:
            _fail(entry[WAITER], exc)

    def _answered(self, key: str, p: _Pending, inner: asyncio.Future[None]) -> None:
        error = None if inner.cancelled() else inner.exception()
        waiter = p.entry[WAITER]
        if error is None and not inner.cancelled():
            _succeed(waiter)
        else:
            _fail(waiter, error or SendError("the send was cancelled", p.entry[MESSAGE_ID]))
        chain = self._chains.get(key)
        if chain is None:
            return
        if error is not None or inner.cancelled():
            while chain:  # stored after a failed one, they could be read out of order: fail them too
                later = chain.popleft()
                self.waiting -= 1
                _fail(
                    later.entry[WAITER],
                    SendError(
                        f"not sent: an earlier message of its order key {key!r} ({p.entry[MESSAGE_ID]}) failed "
                        f"({error}); send the key's messages again from that one",
                        later.entry[MESSAGE_ID],
                        retriable=True,
                    ),
                )
        if chain:
            self.waiting -= 1
            self._send(key, chain.popleft())
            return
        del self._chains[key]
        if not self._chains:
            for fut in self._idle:
                if not fut.done():
                    fut.set_result(None)
            self._idle.clear()

    async def wait_idle(self) -> None:
        """Return once no key has a message waiting or at the sender."""
        if not self._chains:
            return
        fut: asyncio.Future[None] = self._loop.create_future()
        self._idle.append(fut)
        await fut

    def fail_waiting(self, reason: str) -> None:
        """Fail every message still waiting behind its key (the producer is closing)."""
        for chain in self._chains.values():
            while chain:
                p = chain.popleft()
                self.waiting -= 1
                _fail(p.entry[WAITER], SendError(reason, p.entry[MESSAGE_ID], retriable=True))

    async def close(self) -> None:
        for t in list(self._lookups):
            t.cancel()
        for t in list(self._lookups):
            with contextlib.suppress(asyncio.CancelledError):
                await t


def _succeed(waiter: Waiter) -> None:
    if not waiter.done():
        with contextlib.suppress(Exception):
            waiter.set_result(None)


def _fail(waiter: Waiter, exc: BaseException) -> None:
    if not waiter.done():
        with contextlib.suppress(Exception):
            waiter.set_exception(exc)
