"""The firing loop: sleep until the earliest due message, hand what is due to the brokers through
the SDK's producer, and record each broker acknowledgement in the dispatch log.

Messages are handed over ``lead_ms`` before they are due: the broker stores them at once and
makes them visible when due (qmq.store.held), so the hand-over and the broker's fsync are
done by then. The loop sleeps on the event loop's clock for the time the wall clock says is
left, and re-reads the wall clock when it wakes: nothing is handed over earlier than that.
Hand-overs are bounded (``handover_messages_max``, ``handover_bytes_max``); each message in
flight has one small waiter object, resolved by the producer when a broker stored (or
refused) the batch it went in. Acknowledgements are written to the dispatch logs once per
loop turn. A hand-over that fails for a reason that may pass (no broker, a timeout) puts the
message back in the timer and pauses firing with a growing back-off; one a broker refuses
for good is logged and recorded as dispatched, since it can never be delivered.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import math
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from qmq.client.producer import Producer
from qmq.common.clock import Clock
from qmq.common.errors import QmqError, SendError
from qmq.delay.bucket import DISPATCH_DTYPE, DISPATCH_TYPECODE
from qmq.delay.scheduler import LoadJob, Scheduler
from qmq.delay.timer import Rows
from qmq.serving.tracing import ServerTracing, end_spans

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

# Rows handed over per loop turn before the loop yields to the server's other work.
_CHUNK_ROWS = 2_000
# The loop wakes at least this often to load buckets coming due.
_IDLE_WAKE_MS = 1_000
_BACKOFF_S_MIN = 0.05
_BACKOFF_S_MAX = 5.0
_LATENESS_BUCKETS_MS = (1, 2, 5, 10, 20, 50, 100, 250, 500, 1000, 5000, 60_000)
_LAST_MINUTE_S = 60
# A bucket with more messages than this is loaded on a worker thread (about 5 ms of work on the loop).
_LOAD_ON_LOOP_ENTRIES_MAX = 50_000


class _Waiter:
    """The producer's view of one message in flight (``qmq.client.accumulator.Waiter``)."""

    __slots__ = ("_done", "batch", "i", "span")

    def __init__(self, batch: _Batch, i: int, span: Span | None) -> None:
        self.batch = batch
        self.i = i
        self.span = span  # the "fire" span of a traced message (qmq.serving.tracing)
        self._done = False

    def done(self) -> bool:
        return self._done

    def set_result(self, _result: None, /) -> None:
        if not self._done:
            self._done = True
            if self.span is not None:
                end_spans((self.span,))
            self.batch.dispatcher.acked(self.batch, self.i)

    def set_exception(self, exc: BaseException, /) -> None:
        if not self._done:
            self._done = True
            if self.span is not None:
                end_spans((self.span,), str(exc))
            self.batch.dispatcher.failed(self.batch, self.i, exc)


class _Batch:
    __slots__ = ("buckets", "dispatcher", "entries", "left", "rows", "sizes")

    def __init__(self, dispatcher: Dispatcher, rows: Rows) -> None:
        self.dispatcher = dispatcher
        self.left = 0  # messages of it the producer has not settled
        self.rows = rows
        self.buckets: list[int] = rows["bucket"].tolist()
        self.entries: list[int] = rows["entry"].tolist()
        self.sizes: list[int] = rows["size"].tolist()


class Dispatcher:
    def __init__(
        self,
        scheduler: Scheduler,
        producer: Producer,
        clock: Clock,
        *,
        lead_ms: int = 0,
        messages_max: int,
        bytes_max: int,
        on_disk_error: Callable[[BaseException], None],
        tracing: ServerTracing | None = None,
    ) -> None:
        self.scheduler = scheduler
        self.tracing = tracing
        self.producer = producer
        self.clock = clock
        self.lead_ms = lead_ms
        self.messages_max = messages_max
        self.bytes_max = bytes_max
        self.on_disk_error = on_disk_error
        self.in_flight = 0
        self.in_flight_bytes = 0
        self.dispatched_total = 0
        self.refused_total = 0
        self.failures_total = 0
        self.corrupt_total = 0
        # fire lateness (hand-over time - (due - lead)), counted per bucket of _LATENESS_BUCKETS_MS
        self.lateness_counts = np.zeros(len(_LATENESS_BUCKETS_MS) + 1, dtype=np.int64)
        self.lateness_sum_ms = 0
        self._per_second: list[int] = [0] * _LAST_MINUTE_S
        self._second_at: list[int] = [0] * _LAST_MINUTE_S
        self._acks: dict[int, array[int]] = {}
        self._failed: list[Rows] = []
        self._flush_scheduled = False
        self._backoff_s = 0.0
        self._paused_until = 0.0
        self._waiter: asyncio.Future[None] | None = None
        self._wake_at_ms = math.inf
        self._stopping = False
        self._waiting_for_room = False
        self._task: asyncio.Task[None] | None = None
        self._idle: asyncio.Event | None = None
        self._load_executor = ThreadPoolExecutor(1, thread_name_prefix="qmq-delay-load")
        self._loading: set[asyncio.Future[None]] = set()
        self._batches: set[_Batch] = set()  # batches with messages in flight (for cancels)
        scheduler.in_flight_of = self.in_flight_entries

    def in_flight_entries(self, start_ms: int) -> set[int]:
        """Entries of one bucket handed over and not yet in its dispatch log: a cancel cannot stop
        them (O(messages in flight), which ``handover_messages_max`` bounds)."""
        out: set[int] = set()
        for batch in self._batches:
            rows = batch.rows
            out.update(rows["entry"][rows["bucket"] == start_ms].tolist())
        acks = self._acks.get(start_ms)
        if acks is not None:
            out.update(acks)
        return out

    # -- the loop ----------------------------------------------------------------------

    def start(self) -> None:
        self._idle = asyncio.Event()
        self._idle.set()
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        sched = self.scheduler
        clock = self.clock
        while not self._stopping:
            try:
                now = clock.now_ms() + self.lead_ms  # "now" for firing: what is due this soon goes
                self._load(now)
                nd = sched.next_due()
                if nd is not None and nd <= now:
                    paused_s = self._paused_until - loop.time()
                    room = self.messages_max - self.in_flight
                    if paused_s > 0:
                        await self._sleep(paused_s)  # back-off after a failed hand-over
                    elif room > 0 and self.in_flight_bytes < self.bytes_max:
                        rows = sched.take(now, min(room, _CHUNK_ROWS), self.bytes_max - self.in_flight_bytes)
                        self._hand_over(rows, now)
                        await asyncio.sleep(0)  # let sends and acknowledgements in between chunks
                    else:
                        self._waiting_for_room = True
                        await self._sleep(None)  # until acknowledgements free room
                        self._waiting_for_room = False
                    continue
                wake = now + _IDLE_WAKE_MS
                if nd is not None:
                    wake = min(wake, nd)
                nl = sched.next_load_ms()
                if nl is not None:
                    wake = min(wake, max(nl, now + 1))
                self._wake_at_ms = wake
                # Woken early (the loop's timers round), the next turn reads the wall clock again
                # and sleeps the rest: nothing is handed over before its time.
                await self._sleep((wake - now) / 1000)
            except QmqError as exc:
                # a schedule log that cannot be read or written: the disk is failing
                log.critical("the delay server's schedule logs failed (%s); it stops handing messages over", exc)
                self.on_disk_error(exc)
                return

    def _load(self, now_ms: int) -> None:
        """Load the buckets coming due: small ones at once, large ones on a worker thread (reading
        and sorting a large index would hold up firing); their arrivals join the timer meanwhile."""
        sched = self.scheduler
        for b in sched.to_load(now_ms):
            if b.count <= _LOAD_ON_LOOP_ENTRIES_MAX:
                sched.load(b)
                continue
            job = sched.begin_load(b)
            fut = asyncio.get_running_loop().run_in_executor(self._load_executor, job.run)
            self._loading.add(fut)
            fut.add_done_callback(functools.partial(self._loaded, job))

    def _loaded(self, job: LoadJob, fut: asyncio.Future[None]) -> None:
        self._loading.discard(fut)
        if self._stopping:
            return
        try:
            self.scheduler.finish_load(job)
        except QmqError as exc:
            log.critical("the delay server's schedule logs failed (%s); it stops handing messages over", exc)
            self.on_disk_error(exc)
            self._stopping = True
        self.poke()

    async def _sleep(self, delay_s: float | None) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        self._waiter = fut
        handle = loop.call_later(delay_s, _wake, fut) if delay_s is not None else None
        try:
            await fut
        finally:
            if handle is not None:
                handle.cancel()
            self._waiter = None
            self._wake_at_ms = math.inf

    def poke(self) -> None:
        """Wake the loop now (new rows are due earlier than it planned, or room was freed)."""
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def arrived(self, rows: Rows) -> None:
        """Rows of messages that just arrived for loaded buckets (durable under the flush policy)."""
        if not len(rows):
            return
        self.scheduler.timer.add(rows)
        if int(rows["due"].min()) < self._wake_at_ms:
            self.poke()

    # -- hand-over -------------------------------------------------------------------------

    def _hand_over(self, rows: Rows, now_ms: int) -> None:
        rows = self.scheduler.drop_cancelled(rows)
        if not len(rows):
            return
        handover = self.scheduler.read(rows)
        if len(handover.corrupt):
            self.corrupt_total += len(handover.corrupt)
            for start in np.unique(handover.corrupt["bucket"]).tolist():
                mine = handover.corrupt[handover.corrupt["bucket"] == start]
                self.scheduler.dispatched(int(start), mine["entry"].astype(DISPATCH_DTYPE).tobytes())
        rows = handover.rows
        if not len(rows):
            return
        self._observe_lateness(now_ms - rows["due"])
        batch = _Batch(self, rows)
        enqueue = self.producer.enqueue_encoded
        subjects, encoded, ids = handover.subjects, handover.encoded, handover.message_ids
        sizes = batch.sizes
        tracing = self.tracing
        for i in range(len(rows)):
            span = tracing.span_of_message("fire", encoded[i]) if tracing is not None else None
            try:
                enqueue(subjects[i], encoded[i], ids[i], _Waiter(batch, i, span))
            except QmqError as exc:
                # the producer's buffer is sized above the hand-over bounds; this is a closing producer
                self.scheduler.requeue(rows[i:])
                self._pause(exc)
                break
            batch.left += 1
            self.in_flight += 1
            self.in_flight_bytes += sizes[i]
        if not batch.left:
            return
        self._batches.add(batch)
        # on the wire before the loop turns: it may turn through a long intake of new sends first
        self.producer.write_now()
        if self._idle is not None:
            self._idle.clear()

    def acked(self, batch: _Batch, i: int) -> None:
        start = batch.buckets[i]
        acks = self._acks.get(start)
        if acks is None:
            acks = self._acks[start] = array(DISPATCH_TYPECODE)
        acks.append(batch.entries[i])
        self._settled(batch, i)

    def failed(self, batch: _Batch, i: int, exc: BaseException) -> None:
        if isinstance(exc, SendError) and not exc.retriable:
            log.error(
                "a broker refused due message %s for good; it is dropped: %s",
                getattr(exc, "message_id", "?"),
                exc.reason,
            )
            self.refused_total += 1
            self.acked(batch, i)
            return
        self.failures_total += 1
        self._failed.append(batch.rows[i : i + 1])
        if self._backoff_s == 0.0 and len(self._failed) == 1:
            log.warning("handing due messages to a broker failed (%s); retrying with back-off", exc)
        self._settled(batch, i)

    def _settled(self, batch: _Batch, i: int) -> None:
        batch.left -= 1
        if not batch.left:
            self._batches.discard(batch)
        self.in_flight -= 1
        self.in_flight_bytes -= batch.sizes[i]
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._write_settled)

    def _write_settled(self) -> None:
        """Once per loop turn: acknowledged entries to the dispatch logs, failed rows back to the timer."""
        self._flush_scheduled = False
        acks, self._acks = self._acks, {}
        n = 0
        try:
            for start, entries in acks.items():
                n += self.scheduler.dispatched(start, entries.tobytes())
        except QmqError as exc:
            log.critical("cannot write the dispatch log (%s); it stops handing messages over", exc)
            self.on_disk_error(exc)
            self._stopping = True
        self.dispatched_total += n
        self._count_second(n)
        if self._failed:
            failed, self._failed = self._failed, []
            self.scheduler.requeue(np.concatenate(failed))
            self._pause(None)
        elif n:
            self._backoff_s = 0.0
        if self.in_flight == 0 and self._idle is not None:
            self._idle.set()
        if self._waiting_for_room or self._stopping:
            self.poke()

    def _pause(self, exc: BaseException | None) -> None:
        self._backoff_s = min(_BACKOFF_S_MAX, max(_BACKOFF_S_MIN, self._backoff_s * 2))
        self._paused_until = asyncio.get_running_loop().time() + self._backoff_s
        if exc is not None:
            log.warning("handing due messages over paused for %.2f s: %s", self._backoff_s, exc)

    # -- figures ---------------------------------------------------------------------------

    def _observe_lateness(self, lateness_ms: Any) -> None:
        idx = np.searchsorted(np.asarray(_LATENESS_BUCKETS_MS), lateness_ms, side="left")
        self.lateness_counts += np.bincount(idx, minlength=len(self.lateness_counts))
        self.lateness_sum_ms += int(lateness_ms.sum())

    @staticmethod
    def lateness_bounds_ms() -> tuple[int, ...]:
        return _LATENESS_BUCKETS_MS

    def _count_second(self, n: int) -> None:
        if not n:
            return
        sec = self.clock.now_ms() // 1000
        slot = sec % _LAST_MINUTE_S
        if self._second_at[slot] != sec:
            self._second_at[slot] = sec
            self._per_second[slot] = 0
        self._per_second[slot] += n

    def dispatched_last_minute(self) -> int:
        sec = self.clock.now_ms() // 1000
        return sum(c for c, at in zip(self._per_second, self._second_at, strict=True) if sec - at < _LAST_MINUTE_S)

    # -- stop --------------------------------------------------------------------------------

    async def stop(self, grace_s: float) -> None:
        """Stop firing; wait up to ``grace_s`` for the hand-overs in flight; write what was acknowledged."""
        self._stopping = True
        self.poke()
        if self._task is not None:
            await asyncio.gather(self._task, return_exceptions=True)
        if self._loading:
            await asyncio.gather(*self._loading, return_exceptions=True)
        self._load_executor.shutdown(wait=True)
        if self.in_flight and self._idle is not None:
            try:
                async with asyncio.timeout(grace_s):
                    await self._idle.wait()
            except TimeoutError:
                log.warning("shutdown: %d hand-overs unanswered after the grace period", self.in_flight)
        if self._flush_scheduled:
            self._write_settled()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
