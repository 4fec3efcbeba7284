"""The asyncio producer: ``send_nowait`` / ``send`` into the bounded accumulator, drained by the
sender into batched frames.

Path of a message: ``Message.encode()`` once (the only per-message encoding work) → the
accumulator queue of its subject's route → a SEND_MESSAGES frame → the waiter resolved by
the broker's answer. The route of a subject not seen before is asked of the meta server
once; its messages wait aside meanwhile.

A message due later (``set_delay``/``set_deliver_at``) goes to a delay group instead: the
available delay groups form one route, taken in turn, with failover between them like broker
groups. A message due now, in the past, or at most ``HOLD_UNTIL_DUE_MS`` ahead goes to the
brokers, which hold the last kind until it is due (qmq.store.held): never early, and not
behind a delay server's queue of sends.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Iterable
from types import TracebackType
from typing import Literal

from qmq.client.accumulator import ENQUEUED_AT, Accumulator, Entry, RouteKey, Waiter
from qmq.client.connection import ConnectionPool
from qmq.client.message import Message
from qmq.client.meta import MetaClient, describe_target
from qmq.client.options import (
    DEFAULT_CONNECT,
    DEFAULT_PRODUCER,
    ConnectOptions,
    ProducerOptions,
    check_identifier,
    check_url,
)
from qmq.client.sender import ProducerStats, Sender, fail_entries
from qmq.common.errors import BufferFullError, SendError
from qmq.common.limits import HOLD_UNTIL_DUE_MS
from qmq.protocol.codes import RequestCode

log = logging.getLogger(__name__)

_State = Literal["new", "open", "closing", "closed"]
_EXPIRE_PERIOD_S_MAX = 1.0
_DELIVER_AT = struct.Struct("<q")
_DELIVER_AT_POS = 16  # of deliver_at_ms in an encoded message (qmq.protocol.message)


def _is_delayed(deliver_at_ms: int) -> bool:
    return deliver_at_ms > time.time_ns() // 1_000_000 + HOLD_UNTIL_DUE_MS


class Producer:
    """Sends messages to the brokers of a qmq cluster (asyncio).

    Use as ``async with Producer(app_code=..., meta_server=...) as producer:``, or call
    ``await start()`` and ``await close()``. Every option is a keyword with a default; a bad
    value raises ``qmq.ConfigError`` naming it.
    """

    def __init__(
        self,
        *,
        app_code: str,
        meta_server: str,
        buffer_messages_max: int = DEFAULT_PRODUCER.buffer_messages_max,
        buffer_bytes_max: int = DEFAULT_PRODUCER.buffer_bytes_max,
        batch_messages_max: int = DEFAULT_PRODUCER.batch_messages_max,
        batch_bytes_max: int = DEFAULT_PRODUCER.batch_bytes_max,
        max_in_flight: int = DEFAULT_PRODUCER.max_in_flight,
        linger_ms: int = DEFAULT_PRODUCER.linger_ms,
        send_timeout_ms: int = DEFAULT_PRODUCER.send_timeout_ms,
        retry_backoff_ms: int = DEFAULT_PRODUCER.retry_backoff_ms,
        retry_backoff_ms_max: int = DEFAULT_PRODUCER.retry_backoff_ms_max,
        connect_timeout_ms: int = DEFAULT_CONNECT.connect_timeout_ms,
        meta_timeout_ms: int = DEFAULT_CONNECT.meta_timeout_ms,
        close_timeout_ms: int = DEFAULT_CONNECT.close_timeout_ms,
    ) -> None:
        self.app_code = check_identifier("app_code", app_code)
        self.meta_server = check_url("meta_server", meta_server)
        self.connect_options = ConnectOptions(connect_timeout_ms, meta_timeout_ms, close_timeout_ms)
        self.options = ProducerOptions(
            buffer_messages_max=buffer_messages_max,
            buffer_bytes_max=buffer_bytes_max,
            batch_messages_max=batch_messages_max,
            batch_bytes_max=batch_bytes_max,
            max_in_flight=max_in_flight,
            linger_ms=linger_ms,
            send_timeout_ms=send_timeout_ms,
            retry_backoff_ms=retry_backoff_ms,
            retry_backoff_ms_max=retry_backoff_ms_max,
        )
        self.stats = ProducerStats()
        self._state: _State = "new"
        self._meta: MetaClient | None = None
        self._pool: ConnectionPool | None = None
        self._owns_meta = True
        self._acc = Accumulator(self.options.buffer_messages_max, self.options.buffer_bytes_max)
        self._sender: Sender | None = None
        self._routing: dict[str, asyncio.Task[None]] = {}
        # The meta client's routes, cached for the send path; cleared when they change.
        self._routes: dict[str, RouteKey] = {}
        self._delay_route: RouteKey | None = None
        self._expirer: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    @classmethod
    def _sharing(
        cls,
        app_code: str,
        meta_server: str,
        meta: MetaClient,
        pool: ConnectionPool,
        connect_options: ConnectOptions,
    ) -> Producer:
        """A producer over another client's meta client and connections (a consumer's retries)."""
        producer = cls(app_code=app_code, meta_server=meta_server)
        producer.connect_options = connect_options
        producer._meta, producer._pool, producer._owns_meta = meta, pool, False
        return producer

    async def start(self) -> None:
        """Ask the meta server for the brokers; ``qmq.MetaServerError`` naming the URL if it cannot."""
        if self._state != "new":
            if self._state == "open":
                return
            raise SendError("this producer is closed; make a new one")
        self._loop = asyncio.get_running_loop()
        if self._meta is None:
            meta = MetaClient(self.meta_server, timeout_ms=self.connect_options.meta_timeout_ms)
            await meta.start()
            self._meta = meta
            self._pool = ConnectionPool(connect_timeout_ms=self.connect_options.connect_timeout_ms)
        assert self._pool is not None
        self._sender = Sender(self._acc, self._meta, self._pool, self.options, self.stats)
        self._meta.on_change(self._on_meta_change)
        self._sender.reconcile()
        self._expirer = asyncio.ensure_future(self._expire_loop())
        self._state = "open"

    async def __aenter__(self) -> Producer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def generate_message(self, subject: str) -> Message:
        """A new message to ``subject`` with a fresh unique message id."""
        return Message.generate(subject)

    def send_nowait(self, message: Message) -> asyncio.Future[None]:
        """Buffer ``message`` and return at once; the future resolves when it is stored.

        Raises ``qmq.BufferFullError`` at once when the buffer is full (back-pressure), and
        ``InvalidMessageError`` for a message too large. The future fails with
        ``qmq.SendError`` saying why the message could not be stored.
        """
        if self._state != "open":
            raise self._not_open()
        encoded = message.encode()
        fut: asyncio.Future[None] = self._loop.create_future()  # type: ignore[union-attr]
        if message._deliver_at_ms and _is_delayed(message._deliver_at_ms):
            self._enqueue_delayed(encoded, message.message_id, fut)
        else:
            self._enqueue(message.subject, encoded, message.message_id, fut)
        return fut

    async def send(self, message: Message) -> None:
        """Send ``message`` and return once it is stored durably; ``qmq.SendError`` says why not.

        Waits up to ``send_timeout_ms`` for room in a full buffer, then raises
        ``qmq.BufferFullError``.
        """
        await self.send_encoded(message.subject, message.encode(), message.message_id)

    async def send_encoded(self, subject: str, encoded: bytes, message_id: str) -> None:
        """Send a message already encoded (``Message.encode`` or a received message's bytes).

        Its ``deliver_at_ms`` decides where it goes: a delay group when it is due later.
        """
        if self._state != "open":
            raise self._not_open()
        acc = self._acc
        if not acc.has_room(len(encoded)):
            if not await acc.wait_for_room(len(encoded), self.options.send_timeout_ms / 1000):
                raise acc.full_error(len(encoded), message_id)
            if self._state != "open":
                raise self._not_open()
        fut: asyncio.Future[None] = self._loop.create_future()  # type: ignore[union-attr]
        self._route_encoded(subject, encoded, message_id, fut)
        await fut

    def enqueue_encoded(self, subject: str, encoded: bytes, message_id: str, waiter: Waiter) -> None:
        """Buffer an encoded message whose outcome resolves ``waiter`` (for the blocking SDK).

        Runs on the producer's event loop. Raises BufferFullError when there is no room.
        """
        if self._state != "open":
            raise self._not_open()
        self._route_encoded(subject, encoded, message_id, waiter)

    def _route_encoded(self, subject: str, encoded: bytes, message_id: str, waiter: Waiter) -> None:
        (deliver_at_ms,) = _DELIVER_AT.unpack_from(encoded, _DELIVER_AT_POS)
        if deliver_at_ms and _is_delayed(deliver_at_ms):
            self._enqueue_delayed(encoded, message_id, waiter)
        else:
            self._enqueue(subject, encoded, message_id, waiter)

    def _enqueue_delayed(self, encoded: bytes, message_id: str, waiter: Waiter) -> None:
        """Queue a message due later for the delay groups; fail it at once when there is none."""
        key = self._delay_route
        if key is None:
            key = self._delay_route = self._meta.delay_route()  # type: ignore[union-attr]
        if not key:
            self._meta.refresh_soon()  # type: ignore[union-attr]  # one may have registered since
            self.stats.messages_failed += 1
            fail_entries(
                [(encoded, waiter, message_id, 0.0, 0)],
                f"no delay server is registered with the meta server {self.meta_server}, so a message due "
                "later cannot be held; start one (`qmq delay --meta-server URL`, or use `qmq standalone`) "
                "or send without a delay",
                retriable=True,
            )
            return
        self._append(key, (encoded, waiter, message_id, self._loop.time(), self._acc.epoch))  # type: ignore[union-attr]

    def _append(self, key: RouteKey, entry: Entry) -> None:
        sender = self._sender
        assert sender is not None
        if self._acc.append(key, entry):
            sender.wake(key)
        if entry[ENQUEUED_AT] >= sender.next_sweep_at:
            sender.sweep(entry[ENQUEUED_AT])

    def write_now(self) -> None:
        """Write every buffered message whose route is known now, rather than at the sender loops'
        next turn (for a caller on the loop that has just enqueued a batch and wants it on its way)."""
        if self._sender is not None and self._loop is not None:
            self._sender.sweep(self._loop.time(), age_s=0.0)

    def _enqueue(self, subject: str, encoded: bytes, message_id: str, waiter: Waiter) -> None:
        acc = self._acc
        entry: Entry = (encoded, waiter, message_id, self._loop.time(), acc.epoch)  # type: ignore[union-attr]
        key = self._routes.get(subject)
        if key is None:
            key = self._meta.route(subject)  # type: ignore[union-attr]
            if not key:
                acc.hold(subject, entry)
                if key is None:
                    self._route_later(subject)
                return
            self._routes[subject] = key
            # Sends held while the route was looked up go first: the lookup has ended, but the
            # task that queues them may not have run yet (a sync producer's thread gets here first).
            self._route_held(subject, key)
        self._append(key, entry)

    def _route_later(self, subject: str) -> None:
        if subject not in self._routing:
            self._routing[subject] = asyncio.ensure_future(self._route(subject))

    async def _route(self, subject: str) -> None:
        try:
            key = await self._meta.resolve(subject)  # type: ignore[union-attr]
        finally:
            self._routing.pop(subject, None)
        self._route_held(subject, key)

    def _route_held(self, subject: str, key: RouteKey) -> None:
        # Without any broker group the messages stay held until one appears or they expire.
        if key and self._acc.route_held(subject, key):
            self._sender.wake(key)  # type: ignore[union-attr]

    def _on_meta_change(self) -> None:
        if self._state != "open":
            return
        assert self._sender is not None
        assert self._meta is not None
        self._routes.clear()
        self._delay_route = None
        self._sender.reconcile()
        for subject in self._acc.held_subjects():
            key = self._meta.route(subject)
            if key:
                self._route_held(subject, key)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = self.options.send_timeout_ms / 1000
        period_s = min(timeout_s / 4, _EXPIRE_PERIOD_S_MAX)
        while True:
            await asyncio.sleep(period_s)  # periodic housekeeping, not a readiness wait
            expired = self._acc.expire(loop.time() - timeout_s)
            if not expired:
                continue
            by_place: dict[RouteKey | str, list[Entry]] = {}
            for where, entry in expired:
                by_place.setdefault(where, []).append(entry)
            for where, entries in by_place.items():
                if isinstance(where, str):
                    why = f"no broker group was available for subject {where!r}"
                else:
                    why = f"none of {', '.join(map(describe_target, where))} of its route was available"
                self.stats.messages_failed += len(entries)
                fail_entries(
                    entries, f"not sent within send_timeout_ms={self.options.send_timeout_ms}: {why}", retriable=True
                )
                self._acc.release(entries)

    async def prepare(self, subjects: Iterable[str] = ()) -> None:
        """Look up the routes of ``subjects`` and connect to their broker groups now (to every
        available broker group when no subject is given), so a first send waits neither for the
        meta server nor for a TCP connect. Best effort: what fails here the sends try again."""
        if self._state != "open":
            raise self._not_open()
        meta, pool = self._meta, self._pool
        assert meta is not None
        assert pool is not None
        wanted = list(subjects)
        groups: set[str] = set() if wanted else set(meta.groups)
        for subject in wanted:
            key = await meta.resolve(subject)
            if key:
                self._routes.setdefault(subject, key)
                groups.update(key)
        targets = meta.available(sorted(groups))
        results = await asyncio.gather(
            *(pool.get(g.address).request(RequestCode.PING, {}) for g in targets), return_exceptions=True
        )
        for g, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.debug("preparing %s: %s", describe_target(g.name), result)

    async def flush(self, timeout_ms: int | None = None) -> None:
        """Wait until every message buffered before this call is stored or failed.

        Raises ``qmq.SendError`` if that takes longer than ``timeout_ms`` (default
        ``send_timeout_ms``).
        """
        if self._state == "new" or self._state == "closed":
            return
        limit_ms = self.options.send_timeout_ms if timeout_ms is None else timeout_ms
        done = self._acc.begin_flush()
        try:
            async with asyncio.timeout(limit_ms / 1000):
                await done
        except TimeoutError:
            raise SendError(
                f"flush did not finish within {limit_ms} ms: {self._acc.count} messages are still "
                "buffered or in flight",
                retriable=True,
            ) from None

    async def close(self) -> None:
        """Send what is buffered (up to ``close_timeout_ms``), fail the rest, release everything."""
        if self._state in ("closing", "closed"):
            return
        if self._state == "new":
            self._state = "closed"
            return
        self._state = "closing"
        try:
            await self.flush(self.connect_options.close_timeout_ms)
        except SendError as exc:
            log.warning("closing the producer: %s; those messages fail", exc)
        left = self._acc.take_all()
        if left:
            fail_entries(left, "the producer closed before the message was sent", retriable=True)
            self.stats.messages_failed += len(left)
            self._acc.release(left)
        assert self._sender is not None
        assert self._meta is not None
        await self._sender.close()
        tasks = [*self._routing.values(), *([self._expirer] if self._expirer else [])]
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t
        self._meta.off_change(self._on_meta_change)
        if self._owns_meta:
            await self._meta.close()
            if self._pool is not None:
                await self._pool.close()
        self._state = "closed"

    @property
    def buffered(self) -> int:
        """Messages buffered or in flight now."""
        return self._acc.count

    def has_room(self, nbytes: int, extra_messages: int = 0, extra_bytes: int = 0) -> bool:
        """Whether a message of ``nbytes`` fits, with ``extra_*`` more already promised."""
        acc = self._acc
        return acc.count + extra_messages < acc.messages_max and acc.nbytes + extra_bytes + nbytes <= acc.bytes_max

    def full_error(self, nbytes: int, message_id: str | None = None) -> BufferFullError:
        return self._acc.full_error(nbytes, message_id)

    def _not_open(self) -> SendError:
        if self._state == "new":
            return SendError("the producer is not started; use `async with Producer(...)` or `await producer.start()`")
        return SendError("the producer is closed; make a new one")
