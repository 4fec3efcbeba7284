"""``MemoryIdempotentChecker``: records in this process's memory, bounded in count and in time.

For one consumer process whose redeliveries come back to it (a consumer id kept across
reconnects). Nothing survives a restart, and a record pushed out by ``max_entries`` is
forgotten early: the oldest go first.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Awaitable, Callable

from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.idempotency.base import (
    DEFAULT_LEASE_MS,
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

_ENTRIES_MAX = 100_000_000
# Expired records dropped from the oldest end per claim, so a claim's work stays bounded.
_EXPIRE_PER_CLAIM_MAX = 64
_DONE = ""


class _MemoryStore:
    """key → (owner token, or "" once done; expiry on the monotonic clock), oldest first."""

    def __init__(self, max_entries: int, ttl_ms: int, lease_ms: int, clock: Clock) -> None:
        self.max_entries = max_entries
        self._ttl_s = ttl_ms / 1000
        self._lease_s = lease_ms / 1000
        self._clock = clock
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, tuple[str, float]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._entries)

    def claim(self, key: str, token: str) -> Claim:
        now = self._clock.monotonic()
        with self._lock:
            self._expire(now)
            entry = self._entries.get(key)
            if entry is not None and entry[1] > now:
                return Claim.DONE if entry[0] == _DONE else Claim.BUSY
            self._put(key, token, now + self._lease_s)
            return Claim.CLAIMED

    def finish(self, key: str, token: str) -> None:
        now = self._clock.monotonic()
        with self._lock:
            self._put(key, _DONE, now + self._ttl_s)

    def release(self, key: str, token: str) -> None:
        with self._lock:
            entry = self._entries.get(key)
            if entry is not None and entry[0] == token:
                del self._entries[key]

    def _put(self, key: str, owner: str, expires: float) -> None:
        entries = self._entries
        entries[key] = (owner, expires)
        entries.move_to_end(key)
        while len(entries) > self.max_entries:
            entries.popitem(last=False)

    def _expire(self, now: float) -> None:
        # Records are kept in the order they were last written; leases are shorter than
        # TTLs, so this drops most, not all, of what expired; the rest goes at max_entries.
        entries = self._entries
        for _ in range(_EXPIRE_PER_CLAIM_MAX):
            if not entries:
                return
            key, (_, expires) = next(iter(entries.items()))
            if expires > now:
                return
            del entries[key]


class _AsyncView:
    """The memory store seen through the async claim interface (no I/O: nothing awaits)."""

    def __init__(self, store: _MemoryStore) -> None:
        self._store = store

    async def claim(self, key: str, token: str) -> Claim:
        return self._store.claim(key, token)

    async def finish(self, key: str, token: str) -> None:
        self._store.finish(key, token)

    async def release(self, key: str, token: str) -> None:
        self._store.release(key, token)


class MemoryIdempotentChecker:
    """Skips messages this process already processed successfully.

    At most ``max_entries`` records, each kept ``ttl_ms`` after its message was processed.
    ``lease_ms`` bounds how long a delivery being processed keeps a second delivery of the
    same message out. ``key`` picks what identifies a message (default: its id);
    ``group`` keeps consumer groups sharing this checker apart.
    """

    def __init__(
        self,
        *,
        max_entries: int = 100_000,
        ttl_ms: int = 3_600_000,
        lease_ms: int = DEFAULT_LEASE_MS,
        key: KeyFunction | None = None,
        group: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._keys = RecordKeys(key, group)
        self._store = _MemoryStore(
            check_int("max_entries", max_entries, 1, _ENTRIES_MAX),
            check_ttl_ms(ttl_ms),
            check_lease_ms(lease_ms),
            clock,
        )
        self._async = _AsyncView(self._store)

    def __len__(self) -> int:
        """Records held now (done or being processed, expired ones not yet dropped included)."""
        return len(self._store)

    def run(self, message: M, handler: Callable[[M], object]) -> Outcome:
        """Call ``handler(message)`` unless the message was processed; record it if the handler returns."""
        return run_claimed(self._store, self._keys, message, handler)

    async def run_async(self, message: M, handler: Callable[[M], Awaitable[object]]) -> Outcome:
        """``run`` for an ``async def`` handler."""
        return await run_claimed_async(self._async, self._keys, message, handler)
