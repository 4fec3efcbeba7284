"""``RedisIdempotentChecker`` (redis-py) and ``AsyncRedisIdempotentChecker`` (redis.asyncio).

One Redis string per message: ``<prefix>[group/]subject/key``, holding ``p:<token>`` while a
delivery has claimed it (expiring after ``lease_ms``, so a dead consumer's claim goes away
by itself) and ``d`` once processed (expiring after ``ttl_ms``). Each step is one Lua
script, so a claim is one atomic round trip; every script touches one key, so a Redis
Cluster works too.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from qmq.common.errors import ConfigError
from qmq.idempotency.base import (
    DEFAULT_LEASE_MS,
    DEFAULT_TTL_MS,
    Claim,
    KeyFunction,
    M,
    Outcome,
    RecordKeys,
    check_lease_ms,
    check_ttl_ms,
    run_claimed,
    run_claimed_async,
)

if TYPE_CHECKING:
    # redis-py is the application's dependency, not qmq's: imported only for the types.
    import redis
    import redis.asyncio

DEFAULT_PREFIX = "qmq:dedup:"
_PREFIX_CHARS_MAX = 200

# 1: claimed; 0: done before; -1: claimed by another delivery.
_CLAIM = """
if redis.call('SET', KEYS[1], 'p:' .. ARGV[1], 'NX', 'PX', ARGV[2]) then return 1 end
if redis.call('GET', KEYS[1]) == 'd' then return 0 end
return -1
"""
# Done whoever holds the claim now: the handler did finish.
_FINISH = """
redis.call('SET', KEYS[1], 'd', 'PX', ARGV[1])
return 1
"""
_RELEASE = """
if redis.call('GET', KEYS[1]) == 'p:' .. ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""
_CLAIMS = {1: Claim.CLAIMED, 0: Claim.DONE, -1: Claim.BUSY}


def _check_prefix(prefix: object) -> str:
    if not isinstance(prefix, str) or len(prefix) > _PREFIX_CHARS_MAX:
        raise ConfigError(f"prefix={prefix!r} must be a string of at most {_PREFIX_CHARS_MAX} characters")
    return prefix


def _claim_of(answer: Any) -> Claim:
    return _CLAIMS[int(answer)]


class _RedisStore:
    def __init__(self, client: redis.Redis, prefix: str, ttl_ms: int, lease_ms: int) -> None:
        self._prefix = prefix
        self._ttl_ms = ttl_ms
        self._lease_ms = lease_ms
        self._claim = client.register_script(_CLAIM)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)

    def claim(self, key: str, token: str) -> Claim:
        return _claim_of(self._claim(keys=[self._prefix + key], args=[token, self._lease_ms]))

    def finish(self, key: str, token: str) -> None:
        self._finish(keys=[self._prefix + key], args=[self._ttl_ms])

    def release(self, key: str, token: str) -> None:
        self._release(keys=[self._prefix + key], args=[token])


class _AsyncRedisStore:
    def __init__(self, client: redis.asyncio.Redis, prefix: str, ttl_ms: int, lease_ms: int) -> None:
        self._prefix = prefix
        self._ttl_ms = ttl_ms
        self._lease_ms = lease_ms
        self._claim = client.register_script(_CLAIM)
        self._finish = client.register_script(_FINISH)
        self._release = client.register_script(_RELEASE)

    async def claim(self, key: str, token: str) -> Claim:
        return _claim_of(await self._claim(keys=[self._prefix + key], args=[token, self._lease_ms]))

    async def finish(self, key: str, token: str) -> None:
        await self._finish(keys=[self._prefix + key], args=[self._ttl_ms])

    async def release(self, key: str, token: str) -> None:
        await self._release(keys=[self._prefix + key], args=[token])


class RedisIdempotentChecker:
    """Skips messages processed successfully before, recorded in Redis through a ``redis.Redis`` client.

    Records are kept ``ttl_ms`` after processing under ``prefix``; ``lease_ms`` must be
    longer than the handler ever runs. ``key`` picks what identifies a message (default:
    its id); ``group`` keeps consumer groups sharing the prefix apart.
    """

    def __init__(
        self,
        client: redis.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_ms: int = DEFAULT_TTL_MS,
        lease_ms: int = DEFAULT_LEASE_MS,
        key: KeyFunction | None = None,
        group: str | None = None,
    ) -> None:
        self._keys = RecordKeys(key, group)
        self._store = _RedisStore(client, _check_prefix(prefix), check_ttl_ms(ttl_ms), check_lease_ms(lease_ms))

    def run(self, message: M, handler: Callable[[M], object]) -> Outcome:
        """Call ``handler(message)`` unless the message was processed; record it if the handler returns."""
        return run_claimed(self._store, self._keys, message, handler)


class AsyncRedisIdempotentChecker:
    """``RedisIdempotentChecker`` over a ``redis.asyncio.Redis`` client: ``await run_async(message, handler)``."""

    def __init__(
        self,
        client: redis.asyncio.Redis,
        *,
        prefix: str = DEFAULT_PREFIX,
        ttl_ms: int = DEFAULT_TTL_MS,
        lease_ms: int = DEFAULT_LEASE_MS,
        key: KeyFunction | None = None,
        group: str | None = None,
    ) -> None:
        self._keys = RecordKeys(key, group)
        self._store = _AsyncRedisStore(client, _check_prefix(prefix), check_ttl_ms(ttl_ms), check_lease_ms(lease_ms))

    async def run_async(self, message: M, handler: Callable[[M], Awaitable[object]]) -> Outcome:
        """``run`` for an ``async def`` handler."""
        return await run_claimed_async(self._store, self._keys, message, handler)
