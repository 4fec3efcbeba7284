"""Pull consumers: ``await pull()`` batches of one subject as one member of a consumer group,
the retry subject looked at too, and the ordered form that holds one message per order key."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from qmq.client.options import check_int
from qmq.client.ordered_pull import KeyHold
from qmq.client.puller import SubjectPuller
from qmq.client.received import Batch, BatchBase
from qmq.common.errors import QmqError
from qmq.common.limits import DEFAULT_LIMITS

__all__ = ["OrderedPullConsumer", "PullConsumer", "PullConsumerBase", "check_pull_args"]

log = logging.getLogger(__name__)


def check_pull_args(max_messages: object, timeout_ms: object) -> tuple[int, int]:
    limits = DEFAULT_LIMITS
    return (
        check_int("max_messages", max_messages, 1, limits.pull_messages_max),
        check_int("timeout_ms", timeout_ms, 0, limits.pull_timeout_ms_max),
    )


class PullConsumerBase:
    """Pulls of one subject for one consumer group, with its retry subject looked at too."""

    def __init__(self, main: SubjectPuller[Any], retry: SubjectPuller[Any] | None, retry_interval_ms: int) -> None:
        self.subject = main.subject
        self.group = main.group
        self.start_from = main.start_from
        self.subscription = main.subscription
        self._main = main
        self._retry = retry
        self._retry_interval_s = retry_interval_ms / 1000
        self._next_retry_check = 0.0

    @property
    def puller(self) -> SubjectPuller[Any]:
        """The puller of the subject itself (not its retry subject): what PULL_MANY asks."""
        return self._main

    async def _pull(self, max_messages: int, timeout_ms: int) -> BatchBase[Any]:
        max_messages, timeout_ms = check_pull_args(max_messages, timeout_ms)
        loop = asyncio.get_running_loop()
        if self._retry is not None and loop.time() >= self._next_retry_check:
            # Retried messages are few: a look without waiting, every retry_pull_interval_ms
            # (and again at once while it finds some).
            try:
                batch = await self._retry.pull(max_messages, 0)
            except QmqError as exc:
                log.debug("pull of retry subject %r failed: %s", self._retry.subject, exc)
                batch = None
            if batch:
                return batch
            self._next_retry_check = loop.time() + self._retry_interval_s
        return await self._main.pull(max_messages, timeout_ms)

    def retry_due(self) -> SubjectPuller[Any] | None:
        """The retry subject's puller when it is time to look at it (PULL_MANY: client/pull_many.py)."""
        if self._retry is not None and asyncio.get_running_loop().time() >= self._next_retry_check:
            return self._retry
        return None

    def retry_looked(self, found: bool) -> None:
        """The retry subject was looked at: again at once if it had messages, else after the interval."""
        if not found:
            self._next_retry_check = asyncio.get_running_loop().time() + self._retry_interval_s

    @property
    def pulled(self) -> int:
        """Messages returned by pulls so far."""
        return self._main.messages + (self._retry.messages if self._retry is not None else 0)


class PullConsumer(PullConsumerBase):
    """``await pull()`` batches of one subject as one member of a consumer group."""

    async def pull(self, max_messages: int = 100, timeout_ms: int = 1_000) -> Batch:
        """Up to ``max_messages`` messages, waiting up to ``timeout_ms`` for the first (long poll).

        Returns an empty ``Batch`` when none came in time. Acknowledge each message with
        ``m.ack()`` (or the whole batch with ``batch.ack_all()``), or fail it with ``m.nack()``.
        """
        batch = await self._pull(max_messages, timeout_ms)
        assert isinstance(batch, Batch)
        return batch


class OrderedPullConsumer(PullConsumer):
    """A pull consumer of ``ordered=True``: at most one unsettled message per order key
    (``ordered_pull.KeyHold``); a nacked message comes back in place after the back-off."""

    def __init__(self, main: SubjectPuller[Any], retry: SubjectPuller[Any] | None, retry_interval_ms: int) -> None:
        super().__init__(main, None, retry_interval_ms)
        self._hold: KeyHold[Any] = KeyHold(main.subscription, main.on_nack)
        main.on_nack = self._hold.nacked
        main.on_lapse = self._hold.lapsed
        main.may_leave = self._hold.nothing_out

    async def _pull(self, max_messages: int, timeout_ms: int) -> BatchBase[Any]:
        """Up to ``max_messages`` messages, at most one of each order key that has none unsettled,
        waiting up to ``timeout_ms`` for the first. Ack each (``m.ack()``) to get its key's next."""
        max_messages, timeout_ms = check_pull_args(max_messages, timeout_ms)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_ms / 1000
        hold = self._hold
        main = self._main
        make_batch = main._batch_cls
        now = loop.time()
        if any(now >= until - min(1.0, main.lease_s.get(g, 0.0) / 4) for g, until in main.fresh_until.items()):
            # silent for about the lease: ask the broker first, which keeps the slots or says they
            # may be gone (the puller then drops what waits here from that broker group)
            hold.accept(list(await main.pull(max(1, min(hold.room, DEFAULT_LIMITS.pull_messages_max)), 0)))
        while True:
            now = loop.time()
            out = hold.take(max_messages, now)
            if out or now >= deadline:
                return make_batch(out)
            wait_until = deadline
            due = hold.next_due()
            if due is not None:
                wait_until = min(wait_until, due)
            wait_ms = max(0, int((wait_until - now) * 1000))
            room = min(hold.room, DEFAULT_LIMITS.pull_messages_max)
            if room <= 0:
                await asyncio.sleep(min(wait_ms, 50) / 1000)  # everything held waits for acks: look again soon
                continue
            hold.accept(list(await self._main.pull(room, wait_ms)))
