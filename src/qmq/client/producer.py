"""The asyncio producer, ``qmq.aio.Producer``: its API and its lifecycle (the blocking
``qmq.Producer`` in qmq.client.sync is a facade over it).

The way of one message, top to bottom; each step calls only the next and returns to the one
before:

1. API, here: ``send_nowait``, ``send`` and ``enqueue_encoded`` (the blocking SDK's and the
   delay server's hand-over) check that the producer is open, encode the message once (the
   only per-message encoding work), make its waiter and its buffer entry ``(encoded, waiter,
   message_id, enqueued_at, epoch)``. ``send`` first waits up to ``send_timeout_ms`` for room
   in a full buffer; the others raise ``BufferFullError`` at once.
2. routing, ``Router.enqueue`` (qmq.client.routing): a message due more than
   ``HOLD_UNTIL_DUE_MS`` ahead goes to the delay groups, any other to its subject's broker groups.
   The route of a subject not seen before is asked of the meta server once; its messages are
   held in the buffer meanwhile, and the end of the lookup queues them.
3. per-group batch, ``Sender.submit`` (qmq.client.sender): the entry joins its route's queue in
   the accumulator (qmq.client.accumulator), counted against the buffer's bounds until the
   broker answers for it; a queue that was empty wakes the loops of its route's groups, and
   when the caller has held the event loop for a while, frames are written there and then.
4. wire, the sender's loop of each group: the route queues' oldest messages become one
   SEND_MESSAGES frame, at most ``max_in_flight`` outstanding; the broker's answer resolves
   each waiter and frees its room; a frame refused for a reason that may pass is sent again,
   to the route's next group when there is one, until ``send_timeout_ms``.

Beside the path: a change of the meta server's answer goes to ``Router.on_meta_change`` (the
cached routes are dropped, group loops started or stopped, held messages of a subject now
routed queued); the sender fails what was not stored within ``send_timeout_ms``; ``flush``
and ``close`` wait on the accumulator.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import AsyncGenerator, Iterable
from dataclasses import dataclass
from datetime import datetime
from ssl import SSLContext
from types import TracebackType
from typing import Literal

from qmq.client import telemetry
from qmq.client.accumulator import Accumulator, Waiter
from qmq.client.connection import ConnectionPool
from qmq.client.delays import PendingDelay, cancel_everywhere, pending_everywhere, time_ms
from qmq.client.message import Message, subject_bytes
from qmq.client.meta import DELAY_TARGET_PREFIX, MetaClient
from qmq.client.options import (
    DEFAULT_CONNECT,
    DEFAULT_PRODUCER,
    ConnectOptions,
    ProducerOptions,
    authorization_of,
    check_identifier,
    check_url,
    credentials_of,
    secret_of,
)
from qmq.client.ordering import OrderedSends
from qmq.client.routing import Router
from qmq.client.sender import ProducerStats, Sender
from qmq.common.errors import BufferFullError, InvalidMessageError, SendError
from qmq.common.ordering import OrderMode
from qmq.protocol.message import FLAG_REPEAT, FLAGS_POS, ORDER_SLOT_POS

log = logging.getLogger(__name__)

_State = Literal["new", "open", "closing", "closed"]
_DELIVER_AT = struct.Struct("<q")
_DELIVER_AT_POS = 16  # of deliver_at_ms in an encoded message (qmq.protocol.message)
_FAR_FUTURE_MS = 253_402_300_799_999  # the end of the year 9999
_LIST_LIMIT_MAX = 10_000


@dataclass(frozen=True, slots=True)
class _Open:
    """The send path of a started producer: what ``start`` builds, on the running loop."""

    loop: asyncio.AbstractEventLoop
    meta: MetaClient
    pool: ConnectionPool
    sender: Sender
    router: Router
    ordered: OrderedSends


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
        resends: bool = DEFAULT_PRODUCER.resends,
        connect_timeout_ms: int = DEFAULT_CONNECT.connect_timeout_ms,
        meta_timeout_ms: int = DEFAULT_CONNECT.meta_timeout_ms,
        close_timeout_ms: int = DEFAULT_CONNECT.close_timeout_ms,
        secret: str | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.app_code = check_identifier("app_code", app_code)
        self.meta_server = check_url("meta_server", meta_server)
        self.connect_options = ConnectOptions(
            connect_timeout_ms, meta_timeout_ms, close_timeout_ms, secret_of(secret), ssl
        )
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
            resends=resends,
        )
        self.stats = ProducerStats()
        self._state: _State = "new"
        self._acc = Accumulator(self.options.buffer_messages_max, self.options.buffer_bytes_max)
        # Another client's meta client and connections (a consumer's retries), else made by start.
        self._shared: tuple[MetaClient, ConnectionPool] | None = None
        # Set by start; None again from the moment close begins, which refuses new sends.
        self._open: _Open | None = None
        self._ordered: OrderedSends | None = None  # kept while closing, for flush

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
        producer._shared = (meta, pool)
        return producer

    async def start(self) -> None:
        """Ask the meta server for the brokers; ``qmq.MetaServerError`` naming the URL if it cannot."""
        if self._state != "new":
            if self._state == "open":
                return
            raise SendError("this producer is closed; make a new one")
        if self._shared is None:
            meta = MetaClient(
                self.meta_server,
                timeout_ms=self.connect_options.meta_timeout_ms,
                authorization=authorization_of(self.app_code, self.connect_options),
                ssl=self.connect_options.tls(self.meta_server),
            )
            await meta.start()
            pool = ConnectionPool(
                connect_timeout_ms=self.connect_options.connect_timeout_ms,
                credentials=credentials_of(self.app_code, self.connect_options),
                ssl=self.connect_options.tls(self.meta_server),
            )
            pool.authenticate_early(g.address for g in meta.groups.values())
        else:
            meta, pool = self._shared
        sender = Sender(self._acc, meta, pool, self.options, self.stats)
        router = Router(meta, self._acc, sender, strict=self.options.resends)
        if not self.options.resends:
            sender.widen = router.widen
        meta.on_change(router.on_meta_change)
        sender.start()
        telemetry.watch_producer(self)
        loop = asyncio.get_running_loop()
        ordered = OrderedSends(meta, sender.submit, loop, self.options.buffer_messages_max)
        self._open = _Open(loop, meta, pool, sender, router, ordered)
        self._ordered = ordered
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

    def send_nowait(self, message: Message, *, resend: bool = False) -> asyncio.Future[None]:
        """Buffer ``message`` and return at once; the future resolves when it is stored.

        Raises ``qmq.BufferFullError`` at once when the buffer is full (back-pressure), and
        ``InvalidMessageError`` for a message too large. The future fails with
        ``qmq.SendError`` saying why the message could not be stored.

        ``resend=True``: this message may have been sent before (an outbox row, a send whose
        answer never came): it goes only to the broker group its id picks, as every send of a
        producer made with ``resends=True`` does (``ProducerOptions.resends``).
        """
        path = self._open
        if path is None:
            raise self._not_open()
        if telemetry.enabled:
            return self._send_nowait_traced(path, message, resend)
        return self._send_nowait(path, message, resend)

    def _send_nowait_traced(self, path: _Open, message: Message, resend: bool) -> asyncio.Future[None]:
        record = telemetry.begin_send(message)
        try:
            fut = self._send_nowait(path, message, resend)
        except BaseException as exc:
            record.finish(exc)
            raise
        fut.add_done_callback(record.finish_future)
        return fut

    def _send_nowait(self, path: _Open, message: Message, resend: bool) -> asyncio.Future[None]:
        encoded = message.encode()
        fut: asyncio.Future[None] = path.loop.create_future()
        entry = (encoded, fut, message.message_id, path.loop.time(), self._acc.epoch, resend)
        (deliver_at_ms,) = _DELIVER_AT.unpack_from(encoded, _DELIVER_AT_POS)
        if message.order_key is not None:
            _check_ordered(message.message_id, deliver_at_ms)
            path.ordered.enqueue(message.subject, message.order_key, _slot(encoded), message.order, entry)
            return fut
        path.router.enqueue(message.subject, deliver_at_ms, entry, bool(encoded[FLAGS_POS] & FLAG_REPEAT))
        return fut

    async def send(self, message: Message) -> None:
        """Send ``message`` and return once it is stored durably; ``qmq.SendError`` says why not.

        Waits up to ``send_timeout_ms`` for room in a full buffer, then raises
        ``qmq.BufferFullError``.
        """
        if telemetry.enabled:
            record = telemetry.begin_send(message)
            try:
                await self._send(message)
            except BaseException as exc:
                record.finish(exc)
                raise
            record.finish(None)
            return
        await self._send(message)

    async def _send(self, message: Message) -> None:
        """``send`` without telemetry (the blocking SDK's send began its span in the caller's thread)."""
        if message.order_key is None:
            await self.send_encoded(message.subject, message.encode(), message.message_id)
            return
        await self.send_encoded(
            message.subject, message.encode(), message.message_id, order_key=message.order_key, order=message.order
        )

    async def send_encoded(
        self,
        subject: str,
        encoded: bytes,
        message_id: str,
        *,
        order_key: str | None = None,
        order: OrderMode = "strict",
        resend: bool = False,
    ) -> None:
        """Send a message already encoded (``Message.encode`` or a received message's bytes).

        Its ``deliver_at_ms`` decides where it goes: a delay group when it is due later. With
        ``order_key`` (the key ``encoded`` was made with) it is sent in order with that key's
        others. ``resend``: as ``send_nowait``'s.
        """
        path = self._open
        if path is None:
            raise self._not_open()
        acc = self._acc
        if not acc.has_room(len(encoded)):
            if not await acc.wait_for_room(len(encoded), self.options.send_timeout_ms / 1000):
                raise acc.full_error(len(encoded), message_id)
            if self._open is None:
                raise self._not_open()
        fut: asyncio.Future[None] = path.loop.create_future()
        self.enqueue_encoded(subject, encoded, message_id, fut, order_key=order_key, order=order, resend=resend)
        await fut

    def enqueue_encoded(
        self,
        subject: str,
        encoded: bytes,
        message_id: str,
        waiter: Waiter,
        *,
        order_key: str | None = None,
        order: OrderMode = "strict",
        resend: bool = False,
    ) -> None:
        """Buffer an encoded message whose outcome resolves ``waiter`` (for the blocking SDK).

        Runs on the producer's event loop. Raises BufferFullError when there is no room.
        ``resend``: as ``send_nowait``'s.
        """
        path = self._open
        if path is None:
            raise self._not_open()
        (deliver_at_ms,) = _DELIVER_AT.unpack_from(encoded, _DELIVER_AT_POS)
        entry = (encoded, waiter, message_id, path.loop.time(), self._acc.epoch, resend)
        if order_key is not None:
            _check_ordered(message_id, deliver_at_ms)
            path.ordered.enqueue(subject, order_key, _slot(encoded), order, entry)
            return
        path.router.enqueue(subject, deliver_at_ms, entry, bool(encoded[FLAGS_POS] & FLAG_REPEAT))

    async def cancel_delay(self, message_id: str) -> bool:
        """Cancel the delay message ``message_id`` (every copy still pending of a repeating one).

        True: it was pending and will now never be delivered (the cancel is durable on the
        delay server, as a send is). False: it was already handed to a broker (or is being
        handed over now), or no delay group knows it. Every available delay group is asked
        (qmq.client.delays); ``qmq.QmqError`` (retriable) when one that did not answer may hold it.
        """
        path = self._open
        if path is None:
            raise self._not_open()
        conns = {
            g.name.removeprefix(DELAY_TARGET_PREFIX): path.pool.get(g.address) for g in path.meta.delay_groups.values()
        }
        return await cancel_everywhere(conns, message_id, self.options.send_timeout_ms)

    def delay_pending(
        self, subject: str, start: datetime | float | None = None, end: datetime | float | None = None
    ) -> AsyncGenerator[PendingDelay, None]:
        """The delay messages of ``subject`` due in ``[start, end)`` (aware datetimes or epoch
        seconds; None: no bound) that no delay group has handed over yet, by due time.

        ``async for p in producer.delay_pending("order.remind", end=tomorrow): ...``. Every
        available delay group is read page by page, so memory holds one page per group however
        long the backlog. A message due already when it was sent may be missing (it is being
        handed over at once).
        """
        path = self._open
        if path is None:
            raise self._not_open()
        subject_bytes(subject)
        from_ms = time_ms("start", start, 0)
        to_ms = time_ms("end", end, _FAR_FUTURE_MS)
        conns = {
            g.name.removeprefix(DELAY_TARGET_PREFIX): path.pool.get(g.address) for g in path.meta.delay_groups.values()
        }
        return pending_everywhere(conns, subject, from_ms, to_ms)

    async def delay_list(
        self, subject: str, start: datetime | float | None = None, end: datetime | float | None = None, limit: int = 100
    ) -> list[PendingDelay]:
        """The first ``limit`` (1..10,000) of ``delay_pending(subject, start, end)``."""
        if isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= _LIST_LIMIT_MAX:
            raise InvalidMessageError(f"limit = {limit!r} is outside 1..{_LIST_LIMIT_MAX}; use delay_pending for more")
        out: list[PendingDelay] = []
        pending = self.delay_pending(subject, start, end)
        async for item in pending:
            out.append(item)
            if len(out) >= limit:
                break
        await pending.aclose()
        return out

    def write_now(self) -> None:
        """Write every buffered message whose route is known now, rather than at the sender loops'
        next turn (for a caller on the loop that has just enqueued a batch and wants it on its way)."""
        path = self._open
        if path is not None:
            path.sender.sweep(path.loop.time(), age_s=0.0)

    async def prepare(self, subjects: Iterable[str] = ()) -> None:
        """Look up the routes of ``subjects`` and connect to their broker groups now (to every
        available broker group when no subject is given), so a first send waits neither for the
        meta server nor for a TCP connect. Best effort: what fails here the sends try again."""
        path = self._open
        if path is None:
            raise self._not_open()
        wanted = list(subjects)
        groups: set[str] = set() if wanted else set(path.meta.groups)
        for subject in wanted:
            groups.update(await path.router.resolve(subject))
        await path.sender.connect(sorted(groups))

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
                if self._ordered is not None:
                    await self._ordered.wait_idle()
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
        path = self._open
        if path is None:  # never started
            self._state = "closed"
            return
        self._state = "closing"
        self._open = None
        path.meta.off_change(path.router.on_meta_change)
        try:
            await self.flush(self.connect_options.close_timeout_ms)
        except SendError as exc:
            log.warning("closing the producer: %s; those messages fail", exc)
        path.ordered.fail_waiting("the producer closed before the message was sent")
        await path.ordered.close()
        left = self._acc.take_all()
        if left:
            path.sender.fail(left, "the producer closed before the message was sent", retriable=True)
            self._acc.release(left)
        await path.sender.close()
        await path.router.close()
        if self._shared is None:
            await path.meta.close()
            await path.pool.close()
        self._state = "closed"

    @property
    def buffered(self) -> int:
        """Messages buffered or in flight now."""
        return self._acc.count

    @property
    def buffered_bytes(self) -> int:
        """Encoded bytes buffered or in flight now."""
        return self._acc.nbytes

    @property
    def frame_retries(self) -> int:
        """Frames sent again after a failure that may pass, since the producer started."""
        return self.stats.retries

    def has_room(self, nbytes: int, extra_messages: int = 0, extra_bytes: int = 0) -> bool:
        """Whether a message of ``nbytes`` fits, with ``extra_*`` more already promised."""
        return self._acc.has_room(nbytes, extra_messages, extra_bytes)

    def full_error(self, nbytes: int, message_id: str | None = None) -> BufferFullError:
        return self._acc.full_error(nbytes, message_id)

    def _not_open(self) -> SendError:
        if self._state == "new":
            return SendError("the producer is not started; use `async with Producer(...)` or `await producer.start()`")
        return SendError("the producer is closed; make a new one")


def _check_ordered(message_id: str, deliver_at_ms: int) -> None:
    if deliver_at_ms:
        raise InvalidMessageError(
            f"message {message_id} has an order key and a delay; an ordered message is delivered in its "
            "key's order, not at a time: drop set_delay/set_deliver_at, or the order key"
        )


def _slot(encoded: bytes) -> int:
    """The order-key slot written in an encoded message's header (its order_slot - 1)."""
    return int.from_bytes(encoded[ORDER_SLOT_POS : ORDER_SLOT_POS + 2], "little") - 1
