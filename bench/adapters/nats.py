"""NATS JetStream through nats-py: a file-storage stream per cell, `publish_async`
(one PubAck per message), and a durable push consumer created at setup — AckAll for one
member, AckExplicit with a deliver (queue) group when several processes share it.

W7's 1,000 subjects live in one stream (`<family>.>`) and are read by one wildcard
consumer: subjects are cheap inside a stream, and a consumer per subject would measure
nats-py's per-subscription overhead rather than the server."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Sequence
from importlib.metadata import version
from typing import Any

import nats
from nats.aio.msg import Msg
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from bench.adapters.base import Adapter, PushInbox, Received
from bench.settings import Settings

ACK_WAIT_S = 60.0
SOLO_DURABLE = "solo"
GROUP_DURABLE = "group"


def _stream(family: str) -> str:
    return family.upper()


class NatsAdapter(PushInbox, Adapter):
    system = "nats"
    client = f"nats-py {version('nats-py')}"

    def __init__(self, endpoint: dict[str, Any], settings: Settings) -> None:
        PushInbox.__init__(self)
        Adapter.__init__(self, endpoint, settings)
        self._nc: Any = None
        self._js: Any = None
        self._explicit_acks = False

    async def connect(self) -> None:
        self._nc = await nats.connect(
            f"nats://{self.endpoint['host']}:{self.endpoint['port']}", max_reconnect_attempts=3
        )
        # publish_async stalls past this many outstanding PubAcks: above our window.
        self._js = self._nc.jetstream(publish_async_max_pending=max(2 * self.settings.window_messages, 4000))
        self.server_version = self._nc._server_info.get("version")

    async def close(self) -> None:
        if self._nc is not None and not self._nc.is_closed:
            await self._nc.close()

    async def setup(
        self, family: str, subjects: Sequence[str], *, delayed: bool, members: int, prefetch: int
    ) -> None:
        stream = _stream(family)
        with contextlib.suppress(NotFoundError):
            await self._js.delete_stream(stream)
        await self._js.add_stream(
            StreamConfig(
                name=stream,
                subjects=[f"{family}.>"],
                storage=StorageType.FILE,
                retention=RetentionPolicy.LIMITS,
                num_replicas=1,
            )
        )
        if self.groups > 1:
            await self._add_fanout_consumers(stream, family, prefetch)
            return
        shared = members > 1
        await self._js.add_consumer(
            stream,
            config=ConsumerConfig(
                durable_name=GROUP_DURABLE if shared else SOLO_DURABLE,
                deliver_subject=f"deliver.{family}",
                deliver_group=GROUP_DURABLE if shared else None,
                deliver_policy=DeliverPolicy.ALL,
                # AckAll from one member would acknowledge the other members' messages.
                ack_policy=AckPolicy.EXPLICIT if shared else AckPolicy.ALL,
                max_ack_pending=prefetch * max(1, members),
                filter_subject=f"{family}.>",
                ack_wait=ACK_WAIT_S,
            ),
        )

    async def _add_fanout_consumers(self, stream: str, family: str, prefetch: int) -> None:
        """Fan-out (W9): a durable push consumer per group, each reading the whole stream."""
        for i in range(self.groups):
            await self._js.add_consumer(
                stream,
                config=ConsumerConfig(
                    durable_name=f"{GROUP_DURABLE}{i}",
                    deliver_subject=f"deliver.{family}.g{i}",
                    deliver_policy=DeliverPolicy.ALL,
                    ack_policy=AckPolicy.ALL,
                    max_ack_pending=prefetch,
                    filter_subject=f"{family}.>",
                    ack_wait=ACK_WAIT_S,
                ),
            )

    async def send_batch(self, subject: str, bodies: list[bytes]) -> Awaitable[Any]:
        publish = self._js.publish_async
        subject_path = self._subject_path(subject)
        futures = [await publish(subject_path, body) for body in bodies]
        return asyncio.gather(*futures)

    def _subject_path(self, subject: str) -> str:
        family = subject.split("-", 1)[0]
        return f"{family}.{subject}"

    async def delay_unsupported(self) -> str | None:
        return "no delayed delivery in nats-server 2.9 (see NatsServer.delay_unsupported)"

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
        put = self.inbox.put_nowait
        if self.groups > 1:
            for i in range(self.groups):
                await self._js.subscribe(
                    f"{family}.>", durable=f"{GROUP_DURABLE}{i}", stream=_stream(family),
                    cb=self._fanout_callback(i), manual_ack=True,
                )
            return
        shared = members > 1
        self._explicit_acks = shared

        async def on_message(msg: Msg) -> None:
            put((msg.data, msg))

        await self._js.subscribe(
            f"{family}.>",
            queue=GROUP_DURABLE if shared else None,
            durable=GROUP_DURABLE if shared else SOLO_DURABLE,
            stream=_stream(family),
            cb=on_message,
            manual_ack=True,
        )

    def _fanout_callback(self, index: int) -> Any:
        put = self.inbox.put_nowait

        async def on_message(msg: Msg) -> None:
            put((msg.data, (msg, index)))

        return on_message

    def group_of(self, token: Any) -> int:
        index: int = token[1]
        return index

    async def recv_batch(self, max_n: int, timeout_s: float) -> Received:
        return await PushInbox.recv_batch(self, max_n, timeout_s)

    async def ack_batch(self, tokens: list[Any]) -> None:
        if not tokens:
            return
        if self.groups > 1:
            # AckAll per group: its last delivery in the batch acknowledges its earlier ones
            last = {index: msg for msg, index in tokens}
            for msg in last.values():
                await msg.ack()
            return
        if self._explicit_acks:
            for msg in tokens:
                await msg.ack()
        else:
            await tokens[-1].ack()

    async def ack_one(self, token: Any) -> None:
        await token.ack()
