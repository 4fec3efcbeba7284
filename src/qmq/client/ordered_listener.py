"""Ordered listeners: a key's messages handled one at a time, in the order they were handed out.

The pull loops are the plain listener's (``Listener``); what differs is the queue. Messages
wait in one queue per order key, and the ``concurrency`` workers take *keys*, not messages: a
worker runs the head of a key's queue, and only then is the key ready for the next one, so a
key's messages never run concurrently or out of order, while different keys run in parallel.
A message without an order key is a key of its own.

A failing message is retried in place: the worker waits the group's back-off for the attempt
(``retry_backoff``, or ``NeedRetry(after=...)``) and calls the handler again, with ``m.times``
counting attempts, holding its key meanwhile; after ``max_retries`` failures the message goes to
``%DEAD_RETRY%<subject>%<group>`` and the key goes on. Nothing goes through ``%RETRY%``, which
would reorder. The broker hands each slot's messages to one consumer of the group at a time
(docs/ordered.md), so no other consumer runs the key meanwhile.

The broker keeps a consumer's slots while it pulls or acks within the group's lease (given in
each pull's answer). A message starts only while the last answered pull or ack of its broker
group is within the lease, less a margin; a pull that finds the consumer was silent past it
drops what is queued from that group (the broker may have moved it) and starts a new session,
in which the broker hands again whatever is still this consumer's. A handler that runs longer
than the lease can still overlap the next owner: keep ``ordered_lease_ms`` above any handler.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from qmq.client.listener import Listener
from qmq.client.received import M
from qmq.common.errors import AlreadyProcessedError, InvalidMessageError, NeedRetry, error_text

log = logging.getLogger(__name__)

_LEASE_MARGIN_S = 1.0  # a message starts only this long (or a quarter of the lease) before it may lapse
_FRESH_POLL_S = 0.05


def order_key_of(m: Any) -> object:
    """What a message is serialised on: its order key, or itself when it has none."""
    key = m.order_key
    return m if key is None else key


class OrderedListener(Listener[M]):
    """The pull loop and key-taking workers behind one ``@consumer.listener(..., ordered=True)``."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._keys: dict[object, deque[M]] = {}
        self._ready: asyncio.Queue[object] = asyncio.Queue()
        self._active: set[object] = set()  # keys a worker runs now (a key is queued once at most)
        self._main = self._pullers[0]
        self._main.on_lapse = self._lapsed
        self._max_retries = self._pullers[0].subscription.max_retries
        self._backoff_ms = self._pullers[0].subscription.backoff_ms
        self.retried_in_place = 0
        self._loop_time: Callable[[], float] | None = None  # the running loop's clock, once known

    def _accept(self, batch: list[M]) -> None:
        keys = self._keys
        for m in batch:
            key = order_key_of(m)
            queue = keys.get(key)
            if queue is None:
                keys[key] = deque((m,))
                self._ready.put_nowait(key)
            else:
                queue.append(m)

    async def _work(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        while not self._stopping:
            key = await self._ready.get()
            queue = self._keys.get(key)
            if not queue or key in self._active:
                continue  # dropped meanwhile (a stop, a lapsed lease), or run by another worker
            m = queue[0]  # stays at the head while it runs: later messages of the key queue behind it
            if not self._fresh(m) and not await self._still_held(m, key):
                if self._keys.get(key) is queue and queue and queue[0] is m:
                    self._ready.put_nowait(key)  # stopping: left as it is
                elif key in self._keys:
                    self._ready.put_nowait(key)  # its head was dropped: the next one goes on
                continue
            self._active.add(key)
            self._busy.add(me)
            try:
                await self._handle_in_place(m)
            except Exception:  # a bug here must cost one message, never the worker
                log.exception(
                    "listener %s/%s: handling message %s failed; it stays unacknowledged (re-delivered later)",
                    self.subject,
                    self.group,
                    m.printable_id,
                )
            finally:
                self._busy.discard(me)
                self._active.discard(key)
                if self._keys.get(key) is queue:
                    queue.popleft()
                    if queue:
                        self._ready.put_nowait(key)
                    else:
                        del self._keys[key]
                    self._in_app -= 1
                    self._room_freed()

    def _fresh(self, m: M) -> bool:
        """Whether this consumer surely holds ``m``'s slot now (the common case, without waiting)."""
        group = m._tracker.broker_group
        until = self._main.fresh_until.get(group)
        if until is None:
            return True
        lease_s = self._main.lease_s.get(group, 0.0)
        clock = self._loop_time
        if clock is None:
            clock = self._loop_time = asyncio.get_running_loop().time
        return clock() < until - min(_LEASE_MARGIN_S, lease_s / 4)

    async def _still_held(self, m: M, key: object) -> bool:
        """Wait until this consumer surely still holds ``m``'s slot: its broker counts it live (the
        last pull or ack it answered was within the lease, less a margin). False if ``m`` was
        dropped meanwhile (the lease lapsed: ``_lapsed``) or the listener stops."""
        group = m._tracker.broker_group
        loop = asyncio.get_running_loop()
        while not self._stopping:
            until = self._main.fresh_until.get(group)
            lease_s = self._main.lease_s.get(group, 0.0)
            if until is None or loop.time() < until - min(_LEASE_MARGIN_S, lease_s / 4):
                return self._queued(m, key)
            if not self._queued(m, key):
                return False
            await asyncio.sleep(_FRESH_POLL_S)  # waiting for a pull or an ack to be answered
        return False

    def _queued(self, m: M, key: object) -> bool:
        queue = self._keys.get(key)
        return bool(queue) and queue is not None and queue[0] is m

    def _lapsed(self, broker_group: str) -> None:
        """The lease of this consumer at ``broker_group`` may have lapsed (a pull found it silent past
        it): its slots may be another consumer's now, with the messages queued here. Drop those not
        running; the broker hands again what is still this consumer's, in the new session."""
        dropped = 0
        for key, queue in list(self._keys.items()):
            keep = [queue[0]] if key in self._active and queue else []
            rest = [m for m in list(queue)[len(keep) :] if m._tracker.broker_group != broker_group]
            others = len(queue) - len(keep) - len(rest)
            if others:
                dropped += others
                queue.clear()
                queue.extend(keep + rest)
                if not queue:
                    del self._keys[key]
                elif key not in self._active:
                    self._ready.put_nowait(key)
        if dropped:
            self._in_app -= dropped
            self._room_freed()
            log.warning(
                "listener %s/%s: silent past the ordered lease at broker group %s; dropped %d queued "
                "message(s), which the broker hands again if they are still this consumer's",
                self.subject,
                self.group,
                broker_group,
                dropped,
            )

    async def _handle_in_place(self, m: M) -> None:
        """Run the handler on ``m`` until it succeeds, or dead-letter it after ``max_retries`` failures."""
        behaviour = self.behaviour
        if behaviour.consume_most_once:
            m._ack_now()
        problem = m.unreadable()
        if problem is not None:
            self.failed += 1
            unreadable = InvalidMessageError(f"message {m.printable_id} cannot be read: {problem}")
            log.error("listener %s/%s: %s; it goes to the dead letters", self.subject, self.group, unreadable)
            await self._settle_failed(m, unreadable)
            return
        while not self._stopping:
            error: BaseException | None = None
            try:
                if behaviour.filters and not behaviour.pre(m):
                    m._ack_now()
                    return
                await self._handler(m)
            except AlreadyProcessedError:
                m._ack_now()
                return
            except Exception as exc:
                error = exc
                self.failed += 1
            else:
                self.handled += 1
                m._ack_now()
                return
            finally:
                if behaviour.filters:
                    behaviour.post(m, error)
            assert error is not None
            if behaviour.consume_most_once:
                return  # acknowledged on receipt: never again
            if m.times > self._max_retries:
                log.warning(
                    "listener %s/%s: message %s of key %r failed %d time(s); to the dead letters, the key goes on: %s",
                    self.subject,
                    self.group,
                    m.printable_id,
                    getattr(m, "order_key", None),
                    m.times,
                    error_text(error),
                )
                await self._settle_failed(m, error)
                return
            after = error.after_ms if isinstance(error, NeedRetry) else None
            wait_ms = self._backoff_ms(m.times) if after is None else after
            log.info(
                "listener %s/%s: handler failed on message %s (attempt %d), retried in place in %d ms: %s",
                self.subject,
                self.group,
                m.printable_id,
                m.times,
                wait_ms,
                error_text(error),
            )
            await asyncio.sleep(wait_ms / 1000)  # the group's back-off, holding only this key
            m._count_attempt()
            self.retried_in_place += 1

    def _drop_queued(self) -> None:
        self._keys.clear()
        while not self._ready.empty():
            self._ready.get_nowait()

