"""RabbitMQ through pika's AsyncioConnection (about 5× faster than aio-pika against the
same server, per the yardstick): durable quorum queues, persistent messages, publisher
confirms tracked by delivery tag, per-consumer prefetch and basic.ack(multiple)."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from importlib.metadata import version
from typing import Any

import pika  # type: ignore[import-untyped]
from pika.adapters.asyncio_connection import AsyncioConnection  # type: ignore[import-untyped]
from pika.channel import Channel  # type: ignore[import-untyped]

from bench.adapters.base import Adapter, PushInbox, Received
from bench.settings import Settings

RPC_LIMIT_S = 60.0


def _resolve(fut: asyncio.Future[Any], value: Any) -> None:
    if not fut.done():
        fut.set_result(value)


class RabbitMqAdapter(PushInbox, Adapter):
    system = "rabbitmq"
    client = f"pika {version('pika')} AsyncioConnection"

    def __init__(self, endpoint: dict[str, Any], settings: Settings) -> None:
        PushInbox.__init__(self)
        Adapter.__init__(self, endpoint, settings)
        self._queue_args = {"x-queue-type": settings.rabbitmq_queue_type}
        self._conn: AsyncioConnection | None = None
        self._channel: Channel | None = None
        self._closed: asyncio.Future[Any] | None = None
        self._confirming = False
        self._published_tag = 0
        self._confirmed_upto = 0
        self._confirmed_singles: set[int] = set()  # bounded by the producer's window
        self._pending: deque[tuple[int, asyncio.Future[None]]] = deque()
        self._props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)

    @property
    def channel(self) -> Channel:
        assert self._channel is not None, "connect() first"
        return self._channel

    async def connect(self) -> None:
        loop = asyncio.get_running_loop()
        opened: asyncio.Future[AsyncioConnection] = loop.create_future()
        self._closed = loop.create_future()

        def on_open_error(_conn: Any, err: Any) -> None:
            if not opened.done():
                opened.set_exception(ConnectionError(str(err)))

        def on_close(_conn: Any, reason: Any) -> None:
            if self._closed is not None and not self._closed.done():
                self._closed.set_result(reason)
            self._fail_pending(ConnectionError(f"RabbitMQ connection closed: {reason}"))

        # a TLS listener (bench/secure_throughput.py): its port and the CA that signed its certificate
        tls: dict[str, Any] = {}
        if self.endpoint.get("ca_file"):
            import ssl

            context = ssl.create_default_context(cafile=self.endpoint["ca_file"])
            tls["ssl_options"] = pika.SSLOptions(context, self.endpoint["host"])
        params = pika.ConnectionParameters(
            host=self.endpoint["host"],
            port=self.endpoint["port"],
            credentials=pika.PlainCredentials("guest", "guest"),
            **tls,
        )
        self._conn = AsyncioConnection(
            params,
            on_open_callback=lambda conn: _resolve(opened, conn),
            on_open_error_callback=on_open_error,
            on_close_callback=on_close,
            custom_ioloop=loop,
        )
        await asyncio.wait_for(opened, 10.0)
        version = (self._conn.server_properties or {}).get("version")
        self.server_version = version.decode() if isinstance(version, bytes) else version
        channel_open: asyncio.Future[Channel] = loop.create_future()
        self._conn.channel(on_open_callback=channel_open.set_result)
        self._channel = await asyncio.wait_for(channel_open, 10.0)

    async def close(self) -> None:
        if self._conn is not None and not self._conn.is_closed and not self._conn.is_closing:
            self._conn.close()
        if self._closed is not None:
            await asyncio.wait_for(asyncio.shield(self._closed), 5.0)

    def _rpc(self, method: Callable[..., Any], *args: Any, **kwargs: Any) -> asyncio.Future[Any]:
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        method(*args, callback=lambda frame: _resolve(fut, frame), **kwargs)
        return fut

    async def setup(
        self, family: str, subjects: Sequence[str], *, delayed: bool, members: int, prefetch: int
    ) -> None:
        # pika serialises a channel's synchronous RPCs itself; issuing them all at once
        # leaves the server's queue creation as the only cost.
        if self.groups > 1:
            await self._setup_fanout(subjects[0])
            return
        await self.add_subjects(family, subjects)

    async def add_subjects(self, family: str, subjects: Sequence[str]) -> None:
        declares = [
            self._rpc(self.channel.queue_declare, subject, durable=True, arguments=self._queue_args)
            for subject in subjects
        ]
        await asyncio.wait_for(asyncio.gather(*declares), RPC_LIMIT_S + len(subjects) * 0.2)

    def _fanout_queues(self, subject: str) -> list[str]:
        return [f"{subject}.g{i}" for i in range(self.groups)]

    async def _setup_fanout(self, subject: str) -> None:
        """Fan-out (W9): a fanout exchange named after the subject, bound to a queue per group."""
        await asyncio.wait_for(self._rpc(
            self.channel.exchange_declare, subject, exchange_type="fanout", durable=True), RPC_LIMIT_S)
        queues = self._fanout_queues(subject)
        await self.add_subjects(subject, queues)
        binds = [self._rpc(self.channel.queue_bind, queue, subject) for queue in queues]
        await asyncio.wait_for(asyncio.gather(*binds), RPC_LIMIT_S + len(queues) * 0.2)

    # -- producer --------------------------------------------------------------------
    def _on_confirm(self, frame: Any) -> None:
        method = frame.method
        if isinstance(method, pika.spec.Basic.Nack):
            self._fail_pending(RuntimeError(f"RabbitMQ nacked delivery tag {method.delivery_tag}"))
            return
        if method.multiple:
            self._confirmed_upto = max(self._confirmed_upto, method.delivery_tag)
            if self._confirmed_singles:
                self._confirmed_singles = {t for t in self._confirmed_singles if t > self._confirmed_upto}
        else:
            self._confirmed_singles.add(method.delivery_tag)
        while self._confirmed_upto + 1 in self._confirmed_singles:
            self._confirmed_upto += 1
            self._confirmed_singles.discard(self._confirmed_upto)
        while self._pending and self._pending[0][0] <= self._confirmed_upto:
            _tag, fut = self._pending.popleft()
            if not fut.done():
                fut.set_result(None)

    def _fail_pending(self, exc: Exception) -> None:
        while self._pending:
            _tag, fut = self._pending.popleft()
            if not fut.done():
                fut.set_exception(exc)

    async def prepare_producer(self) -> None:
        if not self._confirming:
            await asyncio.wait_for(self._rpc(self.channel.confirm_delivery, self._on_confirm), RPC_LIMIT_S)
            self._confirming = True

    async def send_batch(self, subject: str, bodies: list[bytes]) -> Awaitable[Any]:
        await self.prepare_producer()
        publish = self.channel.basic_publish
        props = self._props
        exchange, key = (subject, "") if self.groups > 1 else ("", subject)
        for body in bodies:
            publish(exchange, key, body, props)
        self._published_tag += len(bodies)
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._pending.append((self._published_tag, fut))
        return fut

    async def delay_unsupported(self) -> str | None:
        return "no native delayed delivery (see RabbitMqServer.delay_unsupported)"

    # -- consumer --------------------------------------------------------------------
    async def start_consumer(
        self,
        family: str,
        subjects: Sequence[str],
        *,
        consumer_index: int,
        members: int,
        prefetch: int,
        delayed: bool,
    ) -> None:
        # Quorum queues have no channel-wide (global) prefetch, so the total in flight
        # is split over the queues this process consumes.
        # (fan-out: `prefetch` is per group already)
        queues = self._fanout_queues(subjects[0]) if self.groups > 1 else list(subjects)
        per_queue = prefetch if self.groups > 1 else max(1, prefetch // len(subjects))
        await asyncio.wait_for(self._rpc(self.channel.basic_qos, prefetch_count=per_queue), RPC_LIMIT_S)
        put = self.inbox.put_nowait

        def on_message_of(index: int) -> Callable[[Any, Any, Any, bytes], None]:
            def on_message(_channel: Any, method: Any, _props: Any, body: bytes) -> None:
                put((body, (method.delivery_tag, index)))

            return on_message

        for index, queue in enumerate(queues):
            self.channel.basic_consume(queue, on_message_of(index))

    async def recv_batch(self, max_n: int, timeout_s: float) -> Received:
        return await PushInbox.recv_batch(self, max_n, timeout_s)

    async def ack_batch(self, tokens: list[Any]) -> None:
        # delivery tags count the channel's deliveries in order, whichever queue they came from
        if tokens:
            self.channel.basic_ack(delivery_tag=max(tag for tag, _index in tokens), multiple=True)

    async def ack_one(self, token: Any) -> None:
        self.channel.basic_ack(delivery_tag=token[0], multiple=False)

    def group_of(self, token: Any) -> int:
        index: int = token[1]
        return index
