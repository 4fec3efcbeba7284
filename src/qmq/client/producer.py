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
from collections.abc import Iterable
from dataclasses import dataclass
from ssl import SSLContext
from types import TracebackType
from typing import Literal

from qmq.client.accumulator import Accumulator, Waiter
from qmq.client.connection import ConnectionPool
from qmq.client.message import Message
from qmq.client.meta import MetaClient
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
from qmq.client.routing import Router
from qmq.client.sender import ProducerStats, Sender
from qmq.common.errors import BufferFullError, SendError

log = logging.getLogger(__name__)

_State = Literal["new", "open", "closing", "closed"]
_DELIVER_AT = struct.Struct("<q")
_DELIVER_AT_POS = 16  # of deliver_at_ms in an encoded message (qmq.protocol.message)


@dataclass(frozen=True, slots=True)
class _Open:
    """The send path of a started producer: what ``start`` builds, on the running loop."""

    loop: asyncio.AbstractEventLoop
    meta: MetaClient
    pool: ConnectionPool
    sender: Sender
    router: Router


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
        )
        self.stats = ProducerStats()
        self._state: _State = "new"
        self._acc = Accumulator(self.options.buffer_messages_max, self.options.buffer_bytes_max)
        # Another client's meta client and connections (a consumer's retries), else made by start.
        self._shared: tuple[MetaClient, ConnectionPool] | None = None
        # Set by start; None again from the moment close begins, which refuses new sends.
        self._open: _Open | None = None

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
        else:
            meta, pool = self._shared
        sender = Sender(self._acc, meta, pool, self.options, self.stats)
        router = Router(meta, self._acc, sender)
        meta.on_change(router.on_meta_change)
        sender.start()
        self._open = _Open(asyncio.get_running_loop(), meta, pool, sender, router)
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
        path = self._open
        if path is None:
            raise self._not_open()
        encoded = message.encode()
        fut: asyncio.Future[None] = path.loop.create_future()
        entry = (encoded, fut, message.message_id, path.loop.time(), self._acc.epoch)
        path.router.enqueue(message.subject, message._deliver_at_ms, entry)
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
        self.enqueue_encoded(subject, encoded, message_id, fut)
        await fut

    def enqueue_encoded(self, subject: str, encoded: bytes, message_id: str, waiter: Waiter) -> None:
        """Buffer an encoded message whose outcome resolves ``waiter`` (for the blocking SDK).

        Runs on the producer's event loop. Raises BufferFullError when there is no room.
        """
        path = self._open
        if path is None:
            raise self._not_open()
        (deliver_at_ms,) = _DELIVER_AT.unpack_from(encoded, _DELIVER_AT_POS)
        entry = (encoded, waiter, message_id, path.loop.time(), self._acc.epoch)
        path.router.enqueue(subject, deliver_at_ms, entry)

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

    def has_room(self, nbytes: int, extra_messages: int = 0, extra_bytes: int = 0) -> bool:
        """Whether a message of ``nbytes`` fits, with ``extra_*`` more already promised."""
        return self._acc.has_room(nbytes, extra_messages, extra_bytes)

    def full_error(self, nbytes: int, message_id: str | None = None) -> BufferFullError:
        return self._acc.full_error(nbytes, message_id)

    def _not_open(self) -> SendError:
        if self._state == "new":
            return SendError("the producer is not started; use `async with Producer(...)` or `await producer.start()`")
        return SendError("the producer is closed; make a new one")
