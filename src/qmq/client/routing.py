"""The producer's routing step: which queue of the send buffer a message joins.

A message due now, in the past, or at most ``HOLD_UNTIL_DUE_MS`` ahead goes to the broker
groups of its subject, which hold the last kind until it is due (qmq.store.held): never early,
and not behind a delay server's queue of sends. A message due later goes to the delay groups:
the available ones form one route, taken in turn, with failover between them like broker
groups.

A message due now goes to one group of its route: the group its message id picks among the
subject's route (rendezvous hashing over the route's group names), while that group takes
sends; the whole route otherwise, taken in turn. So a send of the same message again — the
application retrying a send whose outcome it never learnt, an outbox watchdog resending a row,
a delay server handing over again after a restart — reaches the group that may have stored it,
whose duplicate window drops the repeat; another group would store a second copy, which a
consumer group receives again after it acknowledged the first (found by the fault campaign).
A message known to be such a repeat (``resend=True``, every send of a producer made with
``resends=True``: the outbox's sends, the watchdog's, a delay server's hand-overs) waits for
that group while it takes no sends, and never fails over to another.

The route of a subject not seen before is asked of the meta server once (``MetaClient``
batches the lookups of one loop turn); its messages are held in the buffer meanwhile, and go
to the route's queue, ahead of any sent after it, when the lookup ends. The routes used are
cached here and dropped whenever the meta server's answer changes.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import zlib
from typing import Protocol

from qmq.client.accumulator import ENCODED, MESSAGE_ID, RESEND, Accumulator, Entry, RouteKey
from qmq.client.meta import DELAY_TARGET_PREFIX
from qmq.common.limits import HOLD_UNTIL_DUE_MS
from qmq.protocol.message import HEADER, HEADER_BYTES, order_slot_field


def is_delayed(deliver_at_ms: int) -> bool:
    """Whether a message due at ``deliver_at_ms`` (not 0) goes to a delay group."""
    return deliver_at_ms > time.time_ns() // 1_000_000 + HOLD_UNTIL_DUE_MS


class Routes(Protocol):
    """What routing asks of the meta client (qmq.client.meta.MetaClient)."""

    @property
    def url(self) -> str: ...
    def route(self, subject: str) -> RouteKey | None: ...
    def routed(self, subject: str) -> RouteKey | None: ...
    def send_route(self, subject: str) -> RouteKey | None: ...
    def delay_route(self) -> RouteKey: ...
    def targets(self) -> list[str]: ...
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

    def __init__(self, meta: Routes, acc: Accumulator, sender: Queues, strict: bool = False) -> None:
        """``strict``: every message due now waits for the group its id picks (ProducerOptions.resends);
        otherwise those sent with ``resend=True`` do (the entry's RESEND)."""
        self._meta = meta
        self._acc = acc
        self._sender = sender
        # The meta client's routes, cached for the send path; cleared when they change.
        self._routes: dict[str, RouteKey] = {}
        self._delay_route: RouteKey | None = None
        self._lookups: dict[str, asyncio.Task[None]] = {}
        self._singles: dict[str, RouteKey] = {}  # a route of one group, by its name
        self._strict = strict

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
            if self._strict or entry[RESEND]:
                single = self._repeatable(subject, entry)
                if single is None:
                    self._wait_for_route(subject, entry)
                    return
                key = single
            elif len(key) > 1:
                key = self._pinned(subject, key, entry)
        self._sender.submit(key, entry)

    def widen(self, group: str, entries: list[Entry]) -> RouteKey:
        """The groups the messages of a frame sent to ``group`` alone may fail over to: those of
        every message's route that take sends (``group`` itself when they share none).

        A frame holding a message with an order key stays on ``group``: its key's slot lives
        there (client/ordering.py), and stored elsewhere it could be consumed before the key's
        earlier messages (a strict key waits for its group, as across a master's failover). So
        does a frame holding a resend: ``group`` may have stored it. And a frame sent to a delay
        group: it may have stored the messages (it is not pinned: sender.py) and will hand them
        over to the group each id picks; sent to a broker group instead, a message would be
        stored twice by two groups (found by the fault campaign: a delay server cut off, the
        send failing over to the subject's first broker group)."""
        if group.startswith(DELAY_TARGET_PREFIX) or any(is_ordered(e) or e[RESEND] for e in entries):
            return (group,)
        common: RouteKey | None = None
        for subject in {subject_of(e[ENCODED]) for e in entries}:
            route = self._meta.send_route(subject) or ()
            common = route if common is None else tuple(g for g in common if g in route)
        return common or (group,)

    def _rerouted(self, single: RouteKey, entry: Entry) -> RouteKey:
        """Where a message queued for the group of ``single``, no longer available, goes now
        (a message with an order key, or a resend, nowhere else: it waits there, see ``widen``)."""
        if is_ordered(entry) or entry[RESEND]:
            return single
        subject = subject_of(entry[ENCODED])
        key = self._meta.send_route(subject)
        if not key:
            return single  # nowhere else to go: it waits (or expires) there
        return self._pinned(subject, key, entry) if len(key) > 1 else key

    def _pinned(self, subject: str, key: RouteKey, entry: Entry) -> RouteKey:
        """The group of ``key`` that the entry's message id picks in ``subject``'s route (the
        module docstring), as a route of one; all of ``key`` when that group takes no sends now.
        (A resend, or any message of a strict producer, is never placed here: ``_repeatable``.)"""
        group = pick_group(self._meta.route(subject) or key, entry[MESSAGE_ID])
        if group not in key:
            return key
        return self._single(group)

    def _repeatable(self, subject: str, entry: Entry) -> RouteKey | None:
        """The group a resend (or a strict producer's message) goes to: the one its id picks in
        the route the meta server gave the subject, as a route of one; None while that route is
        not known. Picked among the groups this producer last knew to be available instead (the
        meta server unreachable when the subject was first asked for), a repeat sent by another
        producer, or after the groups changed, could pick another group than the first copy did,
        and both would be stored: a delay server cut off from the meta server, and the delay
        slave promoted meanwhile, each handing over the copy it kept (found by the fault campaign)."""
        route = self._meta.routed(subject)
        return None if route is None else self._single(pick_group(route, entry[MESSAGE_ID]))

    def _wait_for_route(self, subject: str, entry: Entry) -> None:
        """Hold a resend until the meta server's route of its subject is known (the refreshes ask
        for it again; the send fails as usual if that takes longer than ``send_timeout_ms``)."""
        first = not self._acc.holds(subject)
        self._acc.hold(subject, entry)
        if first:
            self._meta.refresh_soon()

    def _single(self, group: str) -> RouteKey:
        single = self._singles.get(group)
        if single is None:
            single = self._singles[group] = (group,)
        return single

    def _first_route(self, subject: str, entry: Entry) -> RouteKey | None:
        """The route of a subject not in the cache; None when ``entry`` is held instead."""
        key = self._meta.send_route(subject)
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
            await self._meta.resolve(subject)
        finally:
            self._lookups.pop(subject, None)
        self._route_held(subject, self._meta.send_route(subject) or ())

    def _route_held(self, subject: str, key: RouteKey) -> None:
        # Without any broker group the messages stay held until one appears or they expire.
        if not key:
            return
        def pick(entry: Entry) -> RouteKey | None:
            if self._strict or entry[RESEND]:
                return self._repeatable(subject, entry)  # None: it stays held
            return self._pinned(subject, key, entry) if len(key) > 1 else key

        for moved in self._acc.route_held(subject, pick):
            self._sender.wake(moved)

    async def resolve(self, subject: str) -> RouteKey:
        """The route of ``subject``, asking the meta server now if it was never asked for."""
        await self._meta.resolve(subject)
        key = self._meta.send_route(subject) or ()
        if key:
            self._routes.setdefault(subject, key)
        return key

    def on_meta_change(self) -> None:
        """The groups or a route changed: drop the cached routes, start or stop the sender loops,
        and queue what was held for subjects that have a route now."""
        self._routes.clear()
        self._delay_route = None
        self._sender.reconcile()
        # what waits for a group that is no longer available goes to the rest of its route
        targets = set(self._meta.targets())
        for group, single in self._singles.items():
            if group not in targets and not self._strict:
                for moved in self._acc.move(single, functools.partial(self._rerouted, single)):
                    self._sender.wake(moved)
        for subject in self._acc.held_subjects():
            key = self._meta.send_route(subject)
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


def pick_group(route: tuple[str, ...], message_id: str) -> str:
    """The group of ``route`` that ``message_id`` goes to (rendezvous hashing: adding or
    removing a group moves only the messages that pick it)."""
    ident = message_id.encode("utf-8", "surrogatepass")
    return max(route, key=lambda group: (zlib.crc32(ident, zlib.crc32(group.encode())), group))


def is_ordered(entry: Entry) -> bool:
    """Whether ``entry`` is a message with an order key (placed by its slot, not its id)."""
    return order_slot_field(entry[ENCODED]) != 0


def subject_of(encoded: bytes) -> str:
    """The subject of an encoded message (qmq.protocol.message)."""
    length = int(HEADER.unpack_from(encoded, 0)[2])
    return bytes(encoded[HEADER_BYTES : HEADER_BYTES + length]).decode("utf-8", "replace")
