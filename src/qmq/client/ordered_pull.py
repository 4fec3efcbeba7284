"""The key hold of an ordered pull consumer: at most one unsettled message per order key.

Pulled messages wait here per key; a pull hands out the head of every key that has nothing
out, so the application never holds two messages of one key at once, and gets them in the order
the broker handed them. A message acked (or dead-lettered) frees its key. A message nacked is
retried in place: it is handed out again, with ``times`` + 1, once the group's back-off for the
attempt has passed, and holds its key meanwhile; after ``max_retries`` failures it goes to the
dead letters (``fail``) and the key goes on. At most ``buffered_max`` messages wait here; pulls
ask the broker only for the room left.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Coroutine
from typing import Any, Generic

from qmq.client.ordered_listener import order_key_of
from qmq.client.received import M
from qmq.client.subscription import Subscription
from qmq.common.errors import NeedRetry

BUFFERED_MAX = 10_000


class KeyHold(Generic[M]):
    """Messages of an ordered pull consumer by key: waiting, out, or due again after a nack."""

    def __init__(
        self,
        sub: Subscription,
        fail: Callable[[Any, BaseException | None], Coroutine[Any, Any, None]],
        buffered_max: int = BUFFERED_MAX,
    ) -> None:
        self._sub = sub
        self._fail = fail
        self.buffered_max = buffered_max
        self._waiting: dict[object, deque[M]] = {}
        self._out: dict[object, M] = {}
        self._again: dict[object, float] = {}  # key -> loop time its nacked message is handed again
        self.buffered = 0

    @property
    def room(self) -> int:
        return max(0, self.buffered_max - self.buffered)

    def accept(self, batch: list[M]) -> None:
        for m in batch:
            key = order_key_of(m)
            q = self._waiting.get(key)
            if q is None:
                q = self._waiting[key] = deque()
            q.append(m)
            self.buffered += 1

    def take(self, max_n: int, now: float) -> list[M]:
        """Up to ``max_n`` messages: those due again after a nack, then the next of each free key."""
        for key, m in list(self._out.items()):
            if m._settled and key not in self._again:
                del self._out[key]
        out: list[M] = []
        for key, due in list(self._again.items()):
            if len(out) >= max_n:
                break
            if due <= now:
                del self._again[key]
                m = self._out[key]
                m._settled = False
                out.append(m)
        for key, q in list(self._waiting.items()):
            if len(out) >= max_n:
                break
            if key in self._out:
                continue
            m = q.popleft()
            if not q:
                del self._waiting[key]
            self.buffered -= 1
            self._out[key] = m
            out.append(m)
        return out

    def lapsed(self, broker_group: str) -> None:
        """The consumer's lease at ``broker_group`` may have lapsed: drop the messages from it that
        wait here (the broker hands again those still this consumer's, in a new session)."""
        for key, q in list(self._waiting.items()):
            kept = [m for m in q if m._tracker.broker_group != broker_group]
            self.buffered -= len(q) - len(kept)
            if kept:
                self._waiting[key] = deque(kept)
            else:
                del self._waiting[key]

    def nothing_out(self) -> bool:
        """Whether every message handed to the application was settled (acked, or dead-lettered)."""
        return not self._again and all(m._settled for m in self._out.values())

    def next_due(self) -> float | None:
        return min(self._again.values()) if self._again else None

    async def nacked(self, m: Any, exc: BaseException | None) -> None:
        """``m.nack()`` of an ordered message: again in place after the back-off, or dead-lettered."""
        if m.times > self._sub.max_retries:
            await self._fail(m, exc)  # to the dead letters (its attempts are used up), acknowledged
            return
        after = exc.after_ms if isinstance(exc, NeedRetry) else None
        wait_ms = self._sub.backoff_ms(m.times) if after is None else after
        m._count_attempt()
        self._again[order_key_of(m)] = asyncio.get_running_loop().time() + wait_ms / 1000
