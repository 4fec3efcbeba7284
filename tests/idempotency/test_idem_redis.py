"""The Redis checkers (redis-py and redis.asyncio) against the real Redis on 127.0.0.1:6379."""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncIterator

import pytest
import redis
import redis.asyncio

from qmq.client.message import Message
from qmq.common.errors import ConfigError
from qmq.idempotency import AsyncRedisIdempotentChecker, MessageInProgressError, Outcome, RedisIdempotentChecker


class Boom(Exception):
    """A handler's failure."""


def test_duplicates_skipped_failures_not_recorded(redis_client: redis.Redis, redis_prefix: str) -> None:
    checker = RedisIdempotentChecker(redis_client, prefix=redis_prefix, ttl_ms=60_000, group="billing")
    m = Message("orders.paid")
    key = f"{redis_prefix}billing/orders.paid/{m.message_id}"
    calls: list[str] = []

    def fail(msg: Message) -> None:
        calls.append("failed")
        raise Boom

    with pytest.raises(Boom):
        checker.run(m, fail)
    assert redis_client.exists(key) == 0, "a failed handler leaves no record"
    assert checker.run(m, lambda msg: calls.append("done")) is Outcome.PROCESSED
    assert checker.run(m, lambda msg: calls.append("again")) is Outcome.DUPLICATE
    assert calls == ["failed", "done"]
    assert redis_client.get(key) == b"d"
    assert 0 < redis_client.pttl(key) <= 60_000, "kept ttl_ms"


def test_in_progress_then_a_dead_claim_expires(redis_client: redis.Redis, redis_prefix: str) -> None:
    checker = RedisIdempotentChecker(redis_client, prefix=redis_prefix, lease_ms=5_000)
    m = Message("s")
    inside, release = threading.Event(), threading.Event()
    results: list[Outcome] = []

    def slow(msg: Message) -> None:
        inside.set()
        assert release.wait(10)

    worker = threading.Thread(target=lambda: results.append(checker.run(m, slow)))
    worker.start()
    try:
        assert inside.wait(10)
        with pytest.raises(MessageInProgressError):
            checker.run(m, lambda msg: None)
    finally:
        release.set()
        worker.join(10)
    assert results == [Outcome.PROCESSED]

    # A consumer that died holding a claim: the claim's key expires by itself after lease_ms.
    short = RedisIdempotentChecker(redis_client, prefix=redis_prefix, lease_ms=100)
    dead = Message("s")
    key = f"{redis_prefix}s/{dead.message_id}"
    redis_client.set(key, "p:a-consumer-that-died", px=100)
    with pytest.raises(MessageInProgressError):
        short.run(dead, lambda msg: None)
    deadline = time.monotonic() + 5
    while redis_client.exists(key):
        assert time.monotonic() < deadline, "the dead claim never expired"
        time.sleep(0.02)  # polling a condition, bounded by the deadline
    assert short.run(dead, lambda msg: None) is Outcome.PROCESSED


def test_bad_prefix_is_named(redis_client: redis.Redis) -> None:
    with pytest.raises(ConfigError, match="prefix=3"):
        RedisIdempotentChecker(redis_client, prefix=3)  # type: ignore[arg-type]


@pytest.fixture
async def async_client() -> AsyncIterator[redis.asyncio.Redis]:
    client = redis.asyncio.Redis(host="127.0.0.1", port=6379)
    yield client
    await client.aclose()


async def test_async_checker(async_client: redis.asyncio.Redis, redis_client: redis.Redis, redis_prefix: str) -> None:
    checker = AsyncRedisIdempotentChecker(async_client, prefix=redis_prefix)
    m = Message("s")
    seen: list[str] = []

    async def handle(msg: Message) -> None:
        seen.append(msg.message_id)

    async def fail(msg: Message) -> None:
        raise Boom

    with pytest.raises(Boom):
        await checker.run_async(m, fail)
    assert await checker.run_async(m, handle) is Outcome.PROCESSED
    assert await checker.run_async(m, handle) is Outcome.DUPLICATE
    assert seen == [m.message_id]
    assert redis_client.get(f"{redis_prefix}s/{m.message_id}") == b"d"
