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
import functools
import logging
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, Generic

from qmq.client import telemetry
from qmq.client.listener_behaviour import ListenerBehaviour
from qmq.client.options import StartFrom
from qmq.client.puller import SubjectPuller
from qmq.client.received import M
from qmq.common.errors import AlreadyProcessedError, AuthError, InvalidMessageError, QmqError, error_text

log = logging.getLogger(__name__)

# Long-poll time of a listener's pulls; short enough that a closing consumer is not held.
_POLL_MS = 5_000
_BACKOFF_S_MIN = 0.1
_BACKOFF_S_MAX = 5.0
# Worker or pull-loop tasks that may end unexpectedly and be replaced before the listener gives up.
_REPLACEMENTS_MAX = 100


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
        self._handler = telemetry.wrap_handler(self.behaviour.wrap(handler), subject, group)
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
        self._replacements = 0
        self.error: str | None = None
        """Why the listener stopped on its own, or None while it runs (``Consumer.errors``)."""

    @property
    def in_flight(self) -> int:
        """Messages queued for the handlers or being handled now."""
        return self._in_app

    @property
    def running(self) -> bool:
        return bool(self._workers)

    def start(self) -> None:
        if self._workers:
            return
        self._stopping = False
        telemetry.watch_listener(self)
        # The main subject pulls once half the prefetch is free, so batches stay large; the
        # retry subject (few messages, long polls) holds at most a quarter of it, which the main
        # subject leaves free: a long poll holds its room while it waits, and a main subject
        # with nothing new would otherwise hold all of it and starve the retries.
        retry_share = max(1, self.prefetch // 4)
        main_most = self.prefetch - retry_share if len(self._pullers) > 1 and self.prefetch > 1 else self.prefetch
        shares = [(main_most, max(1, main_most // 2)), (retry_share, 1)]
        self._loops = []
        for puller, (most, least) in zip(self._pullers, shares, strict=False):
            self._watch(functools.partial(self._pull_loop, puller, most, least), "pull loop", self._loops)
        self._workers = []
        for _ in range(self.concurrency):
            self._watch(self._work, "worker", self._workers)

    def _watch(self, job: Callable[[], Coroutine[Any, Any, None]], what: str, tasks: list[asyncio.Task[None]]) -> None:
        task = asyncio.ensure_future(job())
        task.add_done_callback(functools.partial(self._ended, job, what, tasks))
        tasks.append(task)

    def _ended(
        self,
        job: Callable[[], Coroutine[Any, Any, None]],
        what: str,
        tasks: list[asyncio.Task[None]],
        task: asyncio.Task[None],
    ) -> None:
        """A pull loop or worker ended while the listener runs: say so loudly and start another,
        so the listener never shrinks silently (at most ``_REPLACEMENTS_MAX`` times)."""
        if self._stopping or task not in tasks:
            return
        tasks.remove(task)
        why = "was cancelled" if task.cancelled() else f"failed: {task.exception()!r}"
        self._replacements += 1
        if self._replacements > _REPLACEMENTS_MAX:
            self.error = (
                f"listener {self.subject}/{self.group} stopped: its tasks ended {self._replacements} times "
                f"(the last {what} {why}); see the log, then make a new consumer"
            )
            log.critical("%s", self.error)
            self._stopping = True
            for t in [*self._loops, *self._workers]:
                t.cancel()
            self._loops, self._workers = [], []
            return
        log.critical("listener %s/%s: a %s %s; a new one takes its place", self.subject, self.group, what, why)
        self._watch(job, what, tasks)

    def _stop_on(self, error: str) -> None:
        """Stop the listener on its own for ``error`` (``Consumer.errors`` reports it)."""
        self.error = error
        log.error("%s", error)
        self._stopping = True
        for t in [*self._loops, *self._workers]:
            if t is not asyncio.current_task():
                t.cancel()
        self._loops, self._workers = [], []

    def _free(self) -> int:
        return self.prefetch - self._in_app - self._reserved

    async def _pull_loop(self, puller: SubjectPuller[M], most: int, least: int) -> None:
        failures = 0
        room_free = asyncio.Event()
        while not self._stopping:
            if self._waiting:
                # another loop waits for room (a prefetch of 1 has room for one poll at a time):
                # let it take its turn before this one reserves again
                await asyncio.sleep(0)
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
            except AuthError as exc:
                # the app may not consume here (or its secret is wrong): retrying cannot help
                self._stop_on(f"listener {self.subject}/{self.group} stopped: {exc}")
                return
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
                self._room_freed()
            if batch is None:
                # Bounded exponential back-off before pulling again.
                await asyncio.sleep(min(_BACKOFF_S_MAX, _BACKOFF_S_MIN * 2 ** min(failures - 1, 10)))
                continue
            failures = 0
            if not batch:
                continue
            self._in_app += len(batch)
            self._accept(batch)

    def _accept(self, batch: list[M]) -> None:
        """Queue a pulled batch for the workers."""
        put = self._queue.put_nowait
        for m in batch:
            put(m)

    async def _work(self) -> None:
        me = asyncio.current_task()
        assert me is not None
        queue = self._queue
        while not self._stopping:
            m = await queue.get()
            self._busy.add(me)
            try:
                await self._handle(m)
            except Exception:  # a bug here must cost one message, never the worker
                log.exception(
                    "listener %s/%s: handling message %s failed; it stays unacknowledged (re-delivered later)",
                    self.subject,
                    self.group,
                    m.printable_id,
                )
            finally:
                self._busy.discard(me)
                self._in_app -= 1
                self._room_freed()

    def _room_freed(self) -> None:
        """Wake the pull loops waiting for room that there is now room for."""
        if self._waiting:
            free = self._free()
            for least, ev in self._waiting:
                if free >= least:
                    ev.set()

    async def _handle(self, m: M) -> None:
        behaviour = self.behaviour
        error: BaseException | None = None
        try:
            if behaviour.consume_most_once:
                m._ack_now()  # acknowledged on receipt: whatever happens next, never again
            problem = m.unreadable()
            if problem is not None:
                error = InvalidMessageError(f"message {m.printable_id} cannot be read: {problem}")
                self.failed += 1
                log.error("listener %s/%s: %s; it goes to the dead letters", self.subject, self.group, error)
                await self._settle_failed(m, error)
                return
            if behaviour.filters and not behaviour.pre(m):
                m._ack_now()
                return
            await self._handler(m)
        except AlreadyProcessedError:
            m._ack_now()  # its work was done by an earlier delivery
        except Exception as exc:
            error = exc
            self.failed += 1
            log.warning(
                "listener %s/%s: handler failed on message %s (attempt %d): %s",
                self.subject,
                self.group,
                m.printable_id,
                m.times,
                error_text(exc),
                exc_info=exc,
            )
            await self._settle_failed(m, exc)
        else:
            self.handled += 1
            if behaviour.auto_ack:
                m._ack_now()
        finally:
            if behaviour.filters:
                behaviour.post(m, error)

    async def _settle_failed(self, m: M, exc: BaseException) -> None:
        """Send a failed message to retry (or the dead letters); if that fails it stays unacknowledged."""
        if m._settled:
            return
        m._settled = True
        try:
            await self._fail(m, exc)
        except Exception as send_exc:
            log.error(
                "listener %s/%s: message %s stays unacknowledged (re-delivered later): %s",
                self.subject,
                self.group,
                m.printable_id,
                error_text(send_exc),
                exc_info=not isinstance(send_exc, QmqError),  # a bug: show where
            )

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
        self._drop_queued()
        self._in_app = 0

    def _drop_queued(self) -> None:
        """Forget what is queued beyond ``_queue`` (unacknowledged: re-delivered to the next session)."""
