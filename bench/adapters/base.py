"""The one code shape every system is driven through.

producer:  `send_batch(subject, bodies)` returns an awaitable that completes once the
           server has acknowledged every message of the batch under its durability
           setting; the caller keeps a bounded window of such awaitables in flight.
consumer:  `recv_batch(max_n, timeout_s)` returns [(body, token)]; `ack_batch(tokens)`
           uses the protocol's cheapest "everything in this batch" ack and `ack_one`
           acknowledges one message (the handler-bound workload).

A *family* names the queues/streams/subjects of one measured cell, fresh per cell, so
no cell sees another's messages; `subjects` are the family's subject names.

fan-out:   with `groups` > 1 (W9; the worker sets it before any call) one subject is read by
           that many consumer groups, `setup` makes them, a send reaches every group and a
           consumer reads them all; `group_of(token)` says which group a delivery came from.
many:      `add_subjects` makes more destinations of a family already set up (W10 grows to
           40,000 in chunks).
"""

from __future__ import annotations

import abc
import asyncio
from collections.abc import Awaitable, Sequence
from typing import Any

from bench.settings import Settings

Received = list[tuple[bytes, Any]]


class DelayNotSupported(Exception):
    """The system has no delayed delivery here; str() says why, for the report."""


class Adapter(abc.ABC):
    system = "?"
    client = "?"

    def __init__(self, endpoint: dict[str, Any], settings: Settings) -> None:
        self.endpoint = endpoint
        self.settings = settings
        self.server_version: str | None = None
        self.groups = 1

    @abc.abstractmethod
    async def connect(self) -> None: ...

    @abc.abstractmethod
    async def close(self) -> None: ...

    async def setup(  # noqa: B027 - optional hook: qmq needs no setup
        self, family: str, subjects: Sequence[str], *, delayed: bool, members: int, prefetch: int
    ) -> None:
        """Make fresh, empty destinations (and consumer groups) for a cell."""

    async def add_subjects(self, family: str, subjects: Sequence[str]) -> None:  # noqa: B027 - optional hook
        """Make destinations for more subjects of a family set up before (none where a first send makes one)."""

    def group_of(self, token: Any) -> int:
        """The consumer group (0..groups-1) a delivery came from; 0 without fan-out."""
        return 0

    async def prepare_producer(self) -> None:  # noqa: B027 - optional hook
        """Whatever must happen once before the first send, kept out of the timed part."""

    @abc.abstractmethod
    async def send_batch(self, subject: str, bodies: list[bytes]) -> Awaitable[Any]: ...

    async def delay_unsupported(self) -> str | None:
        """Why delayed delivery cannot be measured here, or None."""
        return None

    async def send_delayed_batch(self, subject: str, items: list[tuple[bytes, float]]) -> Awaitable[Any]:
        """items: (body, due time in epoch seconds)."""
        raise DelayNotSupported(await self.delay_unsupported() or f"{self.system}: no delayed delivery")

    @abc.abstractmethod
    async def start_consumer(
        self,
        family: str,
        subjects: Sequence[str],
        *,
        consumer_index: int,
        members: int,
        prefetch: int,
        delayed: bool,
    ) -> None: ...

    @abc.abstractmethod
    async def recv_batch(self, max_n: int, timeout_s: float) -> Received: ...

    @abc.abstractmethod
    async def ack_batch(self, tokens: list[Any]) -> None: ...

    @abc.abstractmethod
    async def ack_one(self, token: Any) -> None: ...


class PushInbox:
    """recv_batch for push-style clients: the delivery callback appends to `inbox`.

    The inbox is bounded by the server-side prefetch (max unacked deliveries), which is
    why it needs no limit of its own."""

    def __init__(self) -> None:
        self.inbox: asyncio.Queue[tuple[bytes, Any]] = asyncio.Queue()

    async def recv_batch(self, max_n: int, timeout_s: float) -> Received:
        try:
            first = await asyncio.wait_for(self.inbox.get(), timeout_s)
        except TimeoutError:
            return []
        out = [first]
        while len(out) < max_n and not self.inbox.empty():
            out.append(self.inbox.get_nowait())
        return out
