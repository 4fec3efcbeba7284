"""The master's release timer for held messages (qmq.store.held): at each due time, append the
copies of what is due to their subjects and wake the pulls waiting on them.

The timer sleeps on the event loop's clock for the time the wall clock says is left and
re-reads the wall clock when it wakes, so nothing is released before it is due. Only a master
releases: a slave's held records are released by the copies its master sends it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Protocol

from qmq.broker.metrics import BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.common.clock import Clock
from qmq.common.errors import QmqError
from qmq.serving.group_commit import GroupCommit
from qmq.store.broker_store import BrokerStore
from qmq.store.held import release_due

log = logging.getLogger(__name__)

RETRY_MS = 1_000  # after a release failed on a read: the next try


class ReleaseContext(Protocol):
    """What the release timer reads and calls of the broker."""

    @property
    def role(self) -> str: ...
    @property
    def stopping(self) -> bool: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def store(self) -> BrokerStore: ...
    @property
    def metrics(self) -> BrokerMetrics: ...
    @property
    def parked(self) -> ParkedPulls: ...
    @property
    def flusher(self) -> GroupCommit: ...


class Release:
    def __init__(self, broker: ReleaseContext) -> None:
        self.broker = broker
        self._handle: asyncio.Handle | None = None
        self._at_ms: int | None = None  # the due time the timer is set for
        self.released_total = 0

    def schedule(self) -> None:
        """Set the timer for the earliest held message (after a send held some, or on promotion)."""
        broker = self.broker
        if broker.role != "master" or broker.stopping:
            return
        due = broker.store.held.next_due_ms()
        if due is None or (self._at_ms is not None and self._at_ms <= due):
            return
        if self._handle is not None:
            self._handle.cancel()
        self._at_ms = due
        wait_ms = max(0, due - broker.clock.now_ms())
        self._handle = asyncio.get_running_loop().call_later(wait_ms / 1000, self._fire)

    def cancel(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
        self._handle = None
        self._at_ms = None

    def _fire(self) -> None:
        self._handle = None
        self._at_ms = None
        broker = self.broker
        if broker.role != "master" or broker.stopping or broker.flusher.failed is not None:
            return  # held records stay on disk; the next master, or this one restarted, releases them
        store = broker.store
        now = broker.clock.now_ms()  # re-read: the loop's timers round
        try:
            released = release_due(store, now)
        except QmqError as exc:  # a read that failed: the disk may come back
            log.error("held messages could not be released (%s); trying again in %d ms", exc, RETRY_MS)
            self._at_ms = now + RETRY_MS
            self._handle = asyncio.get_running_loop().call_later(RETRY_MS / 1000, self._fire)
            return
        if released is not None:
            result, visible = released
            self.released_total += result.stored
            if result.per_subject:
                broker.metrics.stored(result.per_subject)
                if visible:
                    broker.parked.notify(set(result.per_subject))
                if not visible or store.unflushed_bytes:
                    # A held record still waits for its fsync, or the copies wait in their subject
                    # behind earlier copies that do: a flush that began before these copies were
                    # written would not cover them, so ask for one that does, or with no later
                    # send to this broker they would never become visible (bench.delay_failover).
                    broker.flusher.after_write(store.mlog.end, _ignore)
        due = store.held.next_due_ms()
        if due is not None and due <= now:
            # more are due: released on the next loop turn, after the sends and pulls waiting
            self._at_ms = due
            self._handle = asyncio.get_running_loop().call_soon(self._fire)
        else:
            self.schedule()


def _ignore(_error: str | None) -> None:
    pass
