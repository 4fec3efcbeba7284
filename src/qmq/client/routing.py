"""The producer's routing step: which queue of the send buffer a message joins.

A message due now, in the past, or at most ``HOLD_UNTIL_DUE_MS`` ahead goes to the broker
groups of its subject, which hold the last kind until it is due (qmq.store.held): never early,
and not behind a delay server's queue of sends. A message due later goes to the delay groups:
the available ones form one route, taken in turn, with failover between them like broker
groups.

The route of a subject not seen before is asked of the meta server once (``MetaClient``
batches the lookups of one loop turn); its messages are held in the buffer meanwhile, and go
to the route's queue, ahead of any sent after it, when the lookup ends. The routes used are
cached here and dropped whenever the meta server's answer changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Protocol

from qmq.client.accumulator import Accumulator, Entry, RouteKey
from qmq.common.limits import HOLD_UNTIL_DUE_MS


def is_delayed(deliver_at_ms: int) -> bool:
    """Whether a message due at ``deliver_at_ms`` (not 0) goes to a delay group."""
    return deliver_at_ms > time.time_ns() // 1_000_000 + HOLD_UNTIL_DUE_MS


class Routes(Protocol):
    """What routing asks of the meta client (qmq.client.meta.MetaClient)."""

    @property
    def url(self) -> str: ...
    def route(self, subject: str) -> RouteKey | None: ...
    def delay_route(self) -> RouteKey: ...
    async def resolve(self, subject: str) -> RouteKey: ...
    def refresh_soon(self) -> None: ...


class Queues(Protocol):
    """Where routing puts what it routed (qmq.client.sender.Sender)."""

    def submit(self, key: RouteKey, entry: Entry) -> None: ...
    def wake(self, key: RouteKey) -> None: ...
    def reconcile(self) -> None: ...
    def fail(self, entries: list[Entry], reason: str, *, retriable: bool) -> None: ...


class Router:
    """Puts each message on the queue of its route, holding it while the route is looked up."""

    def __init__(self, meta: Routes, acc: Accumulator, sender: Queues) -> None:
        self._meta = meta
        self._acc = acc
        self._sender = sender
        # The meta client's routes, cached for the send path; cleared when they change.
        self._routes: dict[str, RouteKey] = {}
        self._delay_route: RouteKey | None = None
        self._lookups: dict[str, asyncio.Task[None]] = {}

    def enqueue(self, subject: str, deliver_at_ms: int, entry: Entry, repeating: bool = False) -> None:
        """Queue ``entry`` on its route, or hold it until the route is known.

        Raises BufferFullError when the buffer has no room; fails the entry's waiter at once
        when it is due later (or repeats: only a delay server makes the copies) and no delay
        group is available.
        """
        if repeating or (deliver_at_ms and is_delayed(deliver_at_ms)):
            key = self._delay_route
            if key is None:
                key = self._delay_route = self._meta.delay_route()
            if not key:
                self._no_delay_group(entry)
                return
        else:
            key = self._routes.get(subject)
            if key is None:
                key = self._first_route(subject, entry)
                if key is None:
                    return
        self._sender.submit(key, entry)

    def _first_route(self, subject: str, entry: Entry) -> RouteKey | None:
        """The route of a subject not in the cache; None when ``entry`` is held instead."""
        key = self._meta.route(subject)
        if not key:
            self._acc.hold(subject, entry)
            if key is None and subject not in self._lookups:
                self._lookups[subject] = asyncio.ensure_future(self._look_up(subject))
            return None
        self._routes[subject] = key
        # Sends held while the route was looked up go first: the lookup has ended, but the
        # task that queues them may not have run yet (a sync producer's thread gets here first).
        self._route_held(subject, key)
        return key

    def _no_delay_group(self, entry: Entry) -> None:
        self._meta.refresh_soon()  # one may have registered since
        self._sender.fail(
            [entry],
            f"no delay server is registered with the meta server {self._meta.url}, so a message due "
            "later cannot be held; start one (`qmq delay --meta-server URL`, or use `qmq standalone`) "
            "or send without a delay",
            retriable=True,
        )

    async def _look_up(self, subject: str) -> None:
        try:
            key = await self._meta.resolve(subject)
        finally:
            self._lookups.pop(subject, None)
        self._route_held(subject, key)

    def _route_held(self, subject: str, key: RouteKey) -> None:
        # Without any broker group the messages stay held until one appears or they expire.
        if key and self._acc.route_held(subject, key):
            self._sender.wake(key)

    async def resolve(self, subject: str) -> RouteKey:
        """The route of ``subject``, asking the meta server now if it was never asked for."""
        key = await self._meta.resolve(subject)
        if key:
            self._routes.setdefault(subject, key)
        return key

    def on_meta_change(self) -> None:
        """The groups or a route changed: drop the cached routes, start or stop the sender loops,
        and queue what was held for subjects that have a route now."""
        self._routes.clear()
        self._delay_route = None
        self._sender.reconcile()
        for subject in self._acc.held_subjects():
            key = self._meta.route(subject)
            if key:
                self._route_held(subject, key)

    async def close(self) -> None:
        """Stop the lookups under way; their subjects' held messages stay for the caller to fail."""
        tasks = list(self._lookups.values())
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
