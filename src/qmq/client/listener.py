"""Listeners: a handler called for every message of a subject, acknowledged on return.

One listener runs two pull loops (the subject, and its ``%RETRY%<subject>%<group>`` subject
from the earliest message) that feed one queue, and ``concurrency`` worker tasks that take
messages from it: no task per message. At most ``prefetch`` messages are in the
application (queued or being handled) at once; the loops pull only the room that is left.

A handler that raises fails its message: the consumer re-sends it with ``times + 1`` to the
retry subject (after ``max_retries`` failures, to ``%DEAD_RETRY%``) and then acknowledges
the original. Retried messages come back as soon as they are pulled; a growing back-off
between attempts arrives with the delay server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable
from typing import Generic

from qmq.client.listener_behaviour import ListenerBehaviour
from qmq.client.options import StartFrom
from qmq.client.puller import SubjectPuller
from qmq.client.received import M
from qmq.common.errors import AlreadyProcessedError, QmqError

log = logging.getLogger(__name__)

# Long-poll time of a listener's pulls; short enough that a closing consumer is not held.
_POLL_MS = 5_000
_BACKOFF_S_MIN = 0.1
_BACKOFF_S_MAX = 5.0


class Listener(Generic[M]):
    """The pull loops and workers behind one ``@consumer.listener`` handler."""

    def __init__(
        self,
        subject: str,
        group: str,
        handler: Callable[[M], Awaitable[object]],
        main: SubjectPuller[M],
        retry: SubjectPuller[M] | None,
        fail: Callable[[M, BaseException], Awaitable[None]],
        *,
        start_from: StartFrom,
        concurrency: int,
        prefetch: int,
        behaviour: ListenerBehaviour | None = None,
    ) -> None:
        self.subject = subject
        self.group = group
        self.start_from = start_from
        self.concurrency = concurrency
        self.prefetch = prefetch
        self.behaviour = behaviour or ListenerBehaviour()
        self._handler = self.behaviour.wrap(handler)
        self._fail = fail
        self._pullers = [main] if retry is None else [main, retry]
        self._queue: asyncio.Queue[M] = asyncio.Queue()
        # Messages queued or being handled, plus room promised to pulls in flight: together
        # never above prefetch.
        self._in_app = 0
        self._reserved = 0
        # Pull loops waiting for room: (room they need, event to set once it is free).
        self._waiting: list[tuple[int, asyncio.Event]] = []
        self._loops: list[asyncio.Task[None]] = []
        self._workers: list[asyncio.Task[None]] = []
        self._busy: set[asyncio.Task[None]] = set()
        self._stopping = False
        self.handled = 0
        self.failed = 0

    @property
    def running(self) -> bool:
        return bool(self._workers)

    def start(self) -> None:
        if self._workers:
            return
        self._stopping = False
        # The main subject pulls once half the prefetch is free, so batches stay large; the
        # retry subject (few messages, long polls) holds at most a quarter of it.
        shares = [(self.prefetch, max(1, self.prefetch // 2)), (max(1, self.prefetch // 4), 1)]
        self._loops = [
            asyncio.ensure_future(self._pull_loop(p, most, least))
            for p, (most, least) in zip(self._pullers, shares, strict=False)
        ]
        self._workers = [asyncio.ensure_future(self._work()) for _ in range(self.concurrency)]

    def _free(self) -> int:
        return self.prefetch - self._in_app - self._reserved

    async def _pull_loop(self, puller: SubjectPuller[M], most: int, least: int) -> None:
        failures = 0
        room_free = asyncio.Event()
        while not self._stopping:
            while self._free() < least:
                room_free.clear()
                waiter = (least, room_free)
                self._waiting.append(waiter)
                try:
                    await room_free.wait()
                finally:
                    self._waiting.remove(waiter)
            room = min(most, self._free())
            self._reserved += room
            try:
                batch = await puller.pull(room, _POLL_MS)
            except Exception as exc:
                failures += 1
                if failures == 1 or failures % 20 == 0:
                    log.warning(
                        "listener %s/%s: pulling %r failed %d time(s): %s",
                        self.subject,
                        self.group,
                        puller.subject,
                        failures,
                        exc,
                        exc_info=not isinstance(exc, QmqError),  # a bug: show where
                    )
                batch = None
            finally:
                self._reserved -= room
            if batch is None:
                # Bounded exponential back-off before pulling again.
                await asyncio.sleep(min(_BACKOFF_S_MAX, _BACKOFF_S_MIN * 2 ** min(failures - 1, 10)))
                continue
            failures = 0
            if not batch:
                continue
            self._in_app += len(batch)
            put = self._queue.put_nowait
            for m in batch:
                put(m)

    async def _work(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        queue = self._queue
        handler = self._handler
        behaviour = self.behaviour
        while not self._stopping:
            m = await queue.get()
            self._busy.add(me)
            error: BaseException | None = None
            try:
                if behaviour.consume_most_once:
                    m._ack_now()  # acknowledged on receipt: whatever happens next, never again
                if behaviour.filters and not behaviour.pre(m):
                    m._ack_now()
                    continue
                await handler(m)
            except AlreadyProcessedError:
                m._ack_now()  # its work was done by an earlier delivery
            except Exception as exc:
                error = exc
                self.failed += 1
                log.warning(
                    "listener %s/%s: handler failed on message %s (attempt %d): %r",
                    self.subject,
                    self.group,
                    m.message_id,
                    m.times,
                    exc,
                    exc_info=exc,
                )
                if not m._settled:
                    m._settled = True
                    try:
                        await self._fail(m, exc)
                    except QmqError as send_exc:
                        log.error(
                            "listener %s/%s: message %s stays unacknowledged (re-delivered later): %s",
                            self.subject,
                            self.group,
                            m.message_id,
                            send_exc,
                        )
            else:
                self.handled += 1
                if behaviour.auto_ack:
                    m._ack_now()
            finally:
                if behaviour.filters:
                    behaviour.post(m, error)
                self._busy.discard(me)
                self._in_app -= 1
                if self._waiting:
                    free = self._free()
                    for least, ev in self._waiting:
                        if free >= least:
                            ev.set()

    async def stop(self, timeout_s: float) -> None:
        """Stop pulling; let handlers running now finish (up to ``timeout_s``), then cancel.

        Messages pulled but not handled stay unacknowledged; the broker re-delivers them
        to this consumer id's next session.
        """
        self._stopping = True
        loops, workers = self._loops, self._workers
        self._loops, self._workers = [], []
        for t in loops:
            t.cancel()
        for t in workers:
            if t not in self._busy:
                t.cancel()
        if workers:
            _, pending = await asyncio.wait(workers, timeout=timeout_s)
            for t in pending:
                t.cancel()
        for t in [*loops, *workers]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        while not self._queue.empty():
            self._queue.get_nowait()
        self._in_app = 0
