"""Redis Streams through redis-py (asyncio, hiredis parser): pipelined XADD (the reply
is the ack), XREADGROUP with COUNT/BLOCK, XACK of the batch's ids.

Delayed delivery uses the common pattern, Redis having none of its own: the producer
ZADDs each body with its due time as score, and a poller inside the consumer process
runs a Lua script every `delay_poll_interval_ms` that atomically moves due members into
a ready stream, read like any other."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Sequence
from importlib.metadata import version
from typing import Any

import redis.asyncio as aioredis

from bench.adapters.base import Adapter, Received
from bench.settings import Settings

GROUP = "g"
# Per Lua call: bounds the time the script holds Redis's single thread.
MOVE_PER_CALL_MAX = 1000
# Streams read per XREADGROUP when a consumer reads many (W7).
STREAMS_PER_READ = 50
# Connections of one client process (redis-py's default pool has 100 and fails past them).
CONNECTIONS_MAX = 100
POOL_WAIT_S = 60.0
# Nap of a fan-out consumer (W9) whose groups were all empty (the same for qmq's).
FANOUT_IDLE_S = 0.002
MOVE_DUE_LUA = """
local items = redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', ARGV[1], 'LIMIT', 0, tonumber(ARGV[2]))
for i = 1, #items do redis.call('XADD', KEYS[2], '*', 'd', items[i]) end
if #items > 0 then redis.call('ZREM', KEYS[1], unpack(items)) end
return #items
"""


def _delayed_key(family: str) -> str:
    return f"{family}:delayed"


def _ready_key(family: str) -> str:
    return f"{family}:ready"


class RedisAdapter(Adapter):
    system = "redis"
    client = f"redis-py {version('redis')} + hiredis {version('hiredis')}"

    def __init__(self, endpoint: dict[str, Any], settings: Settings) -> None:
        super().__init__(endpoint, settings)
        self._r: aioredis.Redis | None = None
        self._consumer_name = "c0"
        self._streams: list[str] = []
        self._cursor = 0
        self._poller: asyncio.Task[None] | None = None
        self.poller_stats = {"moved": 0, "polls": 0}

    @property
    def r(self) -> aioredis.Redis:
        assert self._r is not None, "connect() first"
        return self._r

    async def connect(self) -> None:
        # a blocking pool: W10 sends one message per subject, as many pipelines as its window
        # allows, and they wait for one of the pool's connections rather than fail
        pool = aioredis.BlockingConnectionPool(
            host=self.endpoint["host"], port=self.endpoint["port"], decode_responses=False,
            max_connections=CONNECTIONS_MAX, timeout=POOL_WAIT_S,
        )
        self._r = aioredis.Redis.from_pool(pool)  # closing the client closes the pool
        info = await self.r.info("server")
        self.server_version = info.get("redis_version")

    async def close(self) -> None:
        if self._poller is not None:
            self._poller.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._poller
        if self._r is not None:
            await self._r.aclose()

    async def setup(
        self, family: str, subjects: Sequence[str], *, delayed: bool, members: int, prefetch: int
    ) -> None:
        streams = [_ready_key(family)] if delayed else list(subjects)
        pipe = self.r.pipeline(transaction=False)
        pipe.delete(*streams, _delayed_key(family))
        for stream in streams:
            for group in self._group_names():
                pipe.xgroup_create(stream, group, id="0", mkstream=True)
        await pipe.execute()

    def _group_names(self) -> list[str]:
        return [f"{GROUP}{i}" for i in range(self.groups)] if self.groups > 1 else [GROUP]

    async def add_subjects(self, family: str, subjects: Sequence[str]) -> None:
        pipe = self.r.pipeline(transaction=False)
        for stream in subjects:
            pipe.xgroup_create(stream, GROUP, id="0", mkstream=True)
        await pipe.execute()

    async def send_batch(self, subject: str, bodies: list[bytes]) -> Awaitable[Any]:
        pipe = self.r.pipeline(transaction=False)
        for body in bodies:
            pipe.xadd(subject, {b"d": body})
        return asyncio.ensure_future(pipe.execute())

    async def send_delayed_batch(self, subject: str, items: list[tuple[bytes, float]]) -> Awaitable[Any]:
        family = subject.split("-", 1)[0]
        scores = {body: due_s * 1000.0 for body, due_s in items}
        return asyncio.ensure_future(self.r.zadd(_delayed_key(family), scores))

    async def _poll_due(self, family: str) -> None:
        move = self.r.register_script(MOVE_DUE_LUA)
        keys = [_delayed_key(family), _ready_key(family)]
        interval_s = self.settings.delay_poll_interval_ms / 1000.0
        # Ends when the consumer closes (cancel) — the consumer's own deadline bounds it.
        while True:
            moved = int(await move(keys=keys, args=[time.time() * 1000.0, MOVE_PER_CALL_MAX]))
            self.poller_stats["polls"] += 1
            self.poller_stats["moved"] += moved
            if moved < MOVE_PER_CALL_MAX:
                await asyncio.sleep(interval_s)

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
        self._consumer_name = f"c{consumer_index}"
        self._streams = [_ready_key(family)] if delayed else list(subjects)
        if delayed:
            self._poller = asyncio.create_task(self._poll_due(family))

    async def recv_batch(self, max_n: int, timeout_s: float) -> Received:
        if self.groups > 1:
            return await self._recv_groups(max_n, timeout_s)
        if len(self._streams) == 1:
            stream = self._streams[0]
            reply: Any = await self.r.xreadgroup(
                GROUP, self._consumer_name, {stream: ">"}, count=max_n, block=max(1, int(timeout_s * 1000))
            )
            return [(fields[b"d"], (stream, entry_id)) for _s, entries in reply or [] for entry_id, fields in entries]
        return await self._recv_many(max_n, timeout_s)

    async def _recv_many(self, max_n: int, timeout_s: float) -> Received:
        """One pass over the streams in chunks, without blocking; a short sleep if all were empty."""
        chunks = (len(self._streams) + STREAMS_PER_READ - 1) // STREAMS_PER_READ
        per_stream = max(1, max_n // STREAMS_PER_READ)
        for _ in range(chunks):
            start = self._cursor * STREAMS_PER_READ
            self._cursor = (self._cursor + 1) % chunks
            chunk = self._streams[start : start + STREAMS_PER_READ]
            reply: Any = await self.r.xreadgroup(
                GROUP, self._consumer_name, dict.fromkeys(chunk, ">"), count=per_stream
            )
            out: Received = [
                (fields[b"d"], (stream.decode() if isinstance(stream, bytes) else stream, entry_id))
                for stream, entries in reply or []
                for entry_id, fields in entries
            ]
            if out:
                return out
        await asyncio.sleep(min(0.01, timeout_s))
        return []

    async def _recv_groups(self, max_n: int, timeout_s: float) -> Received:
        """Fan-out (W9): one XREADGROUP per group of the one stream, all in one pipeline, without
        blocking; a short sleep if every group was empty."""
        stream = self._streams[0]
        per_group = max(1, max_n // self.groups)
        pipe = self.r.pipeline(transaction=False)
        for group in self._group_names():
            pipe.xreadgroup(group, self._consumer_name, {stream: ">"}, count=per_group)
        replies: list[Any] = await pipe.execute()
        out: Received = [
            (fields[b"d"], (stream, entry_id, index))
            for index, reply in enumerate(replies)
            for _s, entries in reply or []
            for entry_id, fields in entries
        ]
        if not out:
            await asyncio.sleep(min(FANOUT_IDLE_S, timeout_s))
        return out

    def group_of(self, token: Any) -> int:
        index: int = token[2]
        return index

    async def ack_batch(self, tokens: list[Any]) -> None:
        if not tokens:
            return
        if self.groups > 1:
            by_group: dict[int, list[bytes]] = {}
            for _stream, entry_id, index in tokens:
                by_group.setdefault(index, []).append(entry_id)
            pipe = self.r.pipeline(transaction=False)
            for index, ids in by_group.items():
                pipe.xack(tokens[0][0], f"{GROUP}{index}", *ids)
            await pipe.execute()
            return
        by_stream: dict[str, list[bytes]] = {}
        for stream, entry_id in tokens:
            by_stream.setdefault(stream, []).append(entry_id)
        if len(by_stream) == 1:
            (stream, ids), = by_stream.items()
            await self.r.xack(stream, GROUP, *ids)
            return
        pipe = self.r.pipeline(transaction=False)
        for stream, ids in by_stream.items():
            pipe.xack(stream, GROUP, *ids)
        await pipe.execute()

    async def ack_one(self, token: Any) -> None:
        stream, entry_id = token
        await self.r.xack(stream, GROUP, entry_id)
