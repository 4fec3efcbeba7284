"""qmq through its asyncio SDK (`qmq.aio`): `send_nowait` futures that resolve once the
broker stored the batch under its flush policy, pull consumers of one consumer group,
`ack_all` per pulled batch (the SDK turns it into ranges) or `ack` per message.

Written against the SDK contract while the SDK is being built; every call it makes is
listed in bench/README.md so a change of the SDK shows up as one place to fix."""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Sequence
from typing import Any

from bench.adapters.base import Adapter, DelayNotSupported, Received
from bench.settings import Settings

APP_CODE = "bench"
GROUP = "g"
# A full producer buffer raises at once; we wait for an earlier send and retry, this many times.
BUFFER_FULL_RETRIES_MAX = 10_000
BUFFER_FULL_WAIT_S = 0.001
# Subjects pulled concurrently by a consumer of many subjects (W7).
SUBJECTS_PER_PULL_ROUND = 20
# Subjects named in one PULL_MANY (W7): a window that moves on, each call beginning after the
# last subject that had messages (the answer holds at most a round's worth of them)
SUBJECTS_PER_PULL_MANY = 100
# Nap of a fan-out consumer (W9) whose groups were all empty (the same for Redis's).
FANOUT_IDLE_S = 0.002
NO_DELAY_YET = "not yet: delay server (issue 4)"


class QmqAdapter(Adapter):
    system = "qmq"
    client = "qmq.aio"

    def __init__(self, endpoint: dict[str, Any], settings: Settings) -> None:
        super().__init__(endpoint, settings)
        import qmq
        import qmq.aio
        from qmq.common.limits import Limits

        self._aio = qmq.aio
        self._pull_max = Limits().pull_messages_max  # what one pull may ask for
        self._buffer_full: type[BaseException] = getattr(qmq, "BufferFullError", RuntimeError)
        self.server_version = getattr(qmq, "__version__", None)
        self._stack = contextlib.AsyncExitStack()
        self._producer: Any = None
        self._pull_consumers: list[Any] = []
        self._consumer: Any = None
        self._cursor = 0
        # a server with TLS and an auth file (bench/secure_throughput.py): its CA and the app's secret
        self._secure: dict[str, Any] = {}
        if endpoint.get("secret"):
            self._secure["secret"] = endpoint["secret"]
        if endpoint.get("ca_file"):
            import ssl

            self._secure["ssl"] = ssl.create_default_context(cafile=endpoint["ca_file"])

    async def connect(self) -> None:
        await self._stack.__aenter__()

    async def close(self) -> None:
        await self._stack.aclose()

    async def _producer_ready(self) -> Any:
        if self._producer is None:
            self._producer = await self._stack.enter_async_context(
                self._aio.Producer(app_code=APP_CODE, meta_server=self.endpoint["meta_server"], **self._secure)
            )
        return self._producer

    async def prepare_producer(self) -> None:
        await self._producer_ready()

    async def _send_all(self, messages: list[Any]) -> Awaitable[Any]:
        producer = self._producer
        futures: list[Any] = []
        for message in messages:
            for _attempt in range(BUFFER_FULL_RETRIES_MAX):
                try:
                    futures.append(producer.send_nowait(message))
                    break
                except self._buffer_full:
                    pending = [f for f in futures if not f.done()]
                    if pending:
                        await asyncio.wait(pending[:1])
                    else:
                        await asyncio.sleep(BUFFER_FULL_WAIT_S)
            else:
                raise RuntimeError(f"qmq producer buffer stayed full for {BUFFER_FULL_RETRIES_MAX} retries")
        return asyncio.gather(*futures)

    async def send_batch(self, subject: str, bodies: list[bytes]) -> Awaitable[Any]:
        producer = await self._producer_ready()
        messages = []
        for body in bodies:
            message = producer.generate_message(subject)
            message.body = body
            messages.append(message)
        return await self._send_all(messages)

    async def delay_unsupported(self) -> str | None:
        producer = await self._producer_ready()
        probe = producer.generate_message("bench-delay-probe")
        if hasattr(probe, "set_deliver_at") and hasattr(probe, "set_delay"):
            return None
        return NO_DELAY_YET

    async def send_delayed_batch(self, subject: str, items: list[tuple[bytes, float]]) -> Awaitable[Any]:
        reason = await self.delay_unsupported()
        if reason is not None:
            raise DelayNotSupported(reason)
        producer = self._producer
        messages = []
        for body, due_s in items:
            message = producer.generate_message(subject)
            message.body = body
            message.set_deliver_at(due_s)
            messages.append(message)
        return await self._send_all(messages)

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
        consumer = await self._stack.enter_async_context(
            self._aio.Consumer(
                app_code=APP_CODE,
                meta_server=self.endpoint["meta_server"],
                consumer_id=f"bench-{os.getpid()}-{consumer_index}",
                **self._secure,
            )
        )
        self._consumer = consumer
        if self.groups > 1:
            # fan-out (W9): one pull consumer per group of the one subject, pulled together
            self._pull_consumers = [
                consumer.pull_consumer(subjects[0], group=f"{GROUP}{i}", start_from="earliest")
                for i in range(self.groups)
            ]
            return
        self._pull_consumers = [
            consumer.pull_consumer(subject, group=GROUP, start_from="earliest") for subject in subjects
        ]

    async def recv_batch(self, max_n: int, timeout_s: float) -> Received:
        if len(self._pull_consumers) == 1:
            batch = await self._pull_consumers[0].pull(max_messages=max_n, timeout_ms=int(timeout_s * 1000))
            return [(m.body, (m, batch, 0)) for m in batch]
        return await self._recv_many(max_n, timeout_s)

    def group_of(self, token: Any) -> int:
        index: int = token[2]
        return index

    async def _recv_many(self, max_n: int, timeout_s: float) -> Received:
        """Every subject in one request per broker group (PULL_MANY), beginning after the last
        subject that had messages the call before; a client without it pulls rounds of subjects."""
        if not hasattr(self._consumer, "pull_many"):
            return await self._recv_rounds(max_n, timeout_s)
        pcs = self._pull_consumers
        per_subject = max(1, max_n // SUBJECTS_PER_PULL_ROUND)
        for _ in range((len(pcs) + SUBJECTS_PER_PULL_MANY - 1) // SUBJECTS_PER_PULL_MANY):
            start = self._cursor % len(pcs)
            window = (pcs[start:] + pcs[:start])[:SUBJECTS_PER_PULL_MANY]
            # W15's 700 groups × 20 ask more than one pull may
            batches = await self._consumer.pull_many(
                window, max_messages=min(max_n, self._pull_max), per_subject_max=per_subject)
            out = [(m.body, (m, batch, (start + i) % len(pcs))) for i, batch in enumerate(batches) for m in batch]
            if out:
                # the next call begins after the last subject that had messages
                last = max(i for i, batch in enumerate(batches) if batch)
                self._cursor = (start + last + 1) % len(pcs)
                return out
            self._cursor = (start + len(window)) % len(pcs)
        # PULL_MANY does not wait: a fan-out's live latency would see a longer nap
        await asyncio.sleep(min(FANOUT_IDLE_S if self.groups > 1 else 0.01, timeout_s))
        return []

    async def _recv_rounds(self, max_n: int, timeout_s: float) -> Received:
        """Pull a round of subjects at once; the next call starts where this one stopped."""
        count = len(self._pull_consumers)
        per_subject = max(1, max_n // SUBJECTS_PER_PULL_ROUND)
        rounds = (count + SUBJECTS_PER_PULL_ROUND - 1) // SUBJECTS_PER_PULL_ROUND
        for _ in range(rounds):
            start = self._cursor * SUBJECTS_PER_PULL_ROUND
            self._cursor = (self._cursor + 1) % rounds
            chosen = self._pull_consumers[start : start + SUBJECTS_PER_PULL_ROUND]
            batches = await asyncio.gather(*(pc.pull(max_messages=per_subject, timeout_ms=0) for pc in chosen))
            out = [(m.body, (m, batch, start + i)) for i, batch in enumerate(batches) for m in batch]
            if out:
                return out
        await asyncio.sleep(min(0.01, timeout_s))
        return []

    async def ack_batch(self, tokens: list[Any]) -> None:
        batches = {id(batch): batch for _message, batch, _index in tokens}
        if len(batches) == 1:
            await next(iter(batches.values())).ack_all()
            return
        # a pull of many subjects or groups: their acks together, not one round trip after another
        await asyncio.gather(*(batch.ack_all() for batch in batches.values()))

    async def ack_one(self, token: Any) -> None:
        message, _batch, _index = token
        await message.ack()
