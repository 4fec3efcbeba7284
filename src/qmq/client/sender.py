"""The producer's sender, the last steps of a send: a routed message joins its route's queue
in the accumulator (``submit``), and one loop per available broker or delay group turns the
queues into SEND_MESSAGES frames, with at most ``max_in_flight`` frames outstanding per
group, and the retry of whole frames. Messages that were not stored within
``send_timeout_ms`` fail here too, sent or not.

There is no linger by default: a lone message goes at once, and messages that arrive while
frames are in flight coalesce into the next frame. A caller that keeps the event loop busy
(``send_nowait`` in a long loop) would hold its messages back until it yields, since the
sender loops cannot run meanwhile; so each ``submit`` may also ``sweep``: a group whose oldest
queued message waited ``EAGER_AFTER_S`` (or the linger, when longer) gets a frame written
there and then, up to ``EAGER_FRAMES_FACTOR`` times ``max_in_flight`` frames (just the one
when ``max_in_flight`` is 1, which keeps the order of sends).

A frame refused as a whole for a reason that may pass (BUSY, DISK_FULL, SHUTTING_DOWN,
NOT_MASTER, a lost connection) is sent again with the same bytes (the same message ids, so
the broker drops what it already stored), with backoff, to the next broker group of the
route when there is one, until ``send_timeout_ms`` after the oldest message entered the
buffer.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from qmq.client.accumulator import ENCODED, ENQUEUED_AT, MESSAGE_ID, WAITER, Accumulator, Entry, RouteKey
from qmq.client.connection import ConnectionPool
from qmq.client.meta import DELAY_TARGET_PREFIX, MetaClient, describe_target
from qmq.client.options import ProducerOptions
from qmq.common.errors import AuthError, BrokerError, ConnectionLostError, QmqError, SendError
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import RemoteProtocolError, status_name
from qmq.protocol.frame import Frame

log = logging.getLogger(__name__)

_EXPIRE_PERIOD_S_MAX = 1.0
_INVALID_STATE = (asyncio.InvalidStateError, concurrent.futures.InvalidStateError)
# A message queued this long while the caller holds the event loop is written by the next enqueue...
EAGER_AFTER_S = 0.001
# ...in a frame beyond max_in_flight, up to this many times max_in_flight outstanding per group.
EAGER_FRAMES_FACTOR = 2


@dataclass(slots=True)
class ProducerStats:
    """Counters of one producer since it started."""

    frames_sent: int = 0  # SEND_MESSAGES requests attempted, retries included
    messages_sent: int = 0  # messages in those frames
    messages_stored: int = 0  # messages the broker stored (duplicates included)
    duplicates: int = 0  # messages the broker had already stored (a retry after a lost answer)
    messages_failed: int = 0  # messages whose send raised SendError
    retries: int = 0  # frames sent again after a retriable failure


class Sender:
    """The queues and the sender loops of one producer, one loop per available broker or delay group."""

    def __init__(
        self,
        acc: Accumulator,
        meta: MetaClient,
        pool: ConnectionPool,
        options: ProducerOptions,
        stats: ProducerStats,
    ) -> None:
        self._acc = acc
        self._meta = meta
        self._pool = pool
        self._opts = options
        self.stats = stats
        self._loops: dict[str, asyncio.Task[None]] = {}
        self.ready: dict[str, asyncio.Event] = {}
        self._in_flight: dict[str, int] = {}  # frames outstanding per group
        self._slot_freed: dict[str, asyncio.Event] = {}
        self._turn: dict[RouteKey, int] = {}
        self._batches: set[asyncio.Task[None]] = set()
        self._eager_after_s = max(EAGER_AFTER_S, options.linger_ms / 1000)
        # max_in_flight=1 promises order across retries: no eager frame may pass one being retried
        self._eager_frames_max = options.max_in_flight * (EAGER_FRAMES_FACTOR if options.max_in_flight > 1 else 1)
        self._next_sweep_at = 0.0
        self._expirer: asyncio.Task[None] | None = None
        # the route of a frame sent to the one group its messages' ids picked (routing.py), for
        # a failover when that group surely did not store it; set by the producer
        self.widen: Callable[[str, list[Entry]], RouteKey] | None = None

    def start(self) -> None:
        """Start the loops of the groups available now, and the expiry of messages left unsent."""
        self.reconcile()
        self._expirer = asyncio.ensure_future(self._expire_loop())

    def submit(self, key: RouteKey, entry: Entry) -> None:
        """Queue ``entry`` for the groups of ``key``: wake them when their queue was empty, and
        write frames now when the caller has held the event loop (``sweep``). BufferFullError
        when the buffer has no room."""
        if self._acc.append(key, entry):
            self.wake(key)
        if entry[ENQUEUED_AT] >= self._next_sweep_at:
            self.sweep(entry[ENQUEUED_AT])

    def reconcile(self) -> None:
        """Start a loop for each available broker or delay group, stop those of groups gone."""
        groups = set(self._meta.targets())
        for name in groups:
            if name not in self._loops:
                self.ready[name] = asyncio.Event()
                self._slot_freed[name] = asyncio.Event()
                self._in_flight.setdefault(name, 0)
                self._loops[name] = asyncio.ensure_future(self._run(name))
        for name in [n for n in self._loops if n not in groups]:
            self._loops.pop(name).cancel()
            self.ready.pop(name, None)
        self.wake_all()

    def wake(self, key: RouteKey) -> None:
        """Wake the senders of ``key``'s groups (its queue just stopped being empty).

        The first woken takes the batch; the order rotates, so the groups of a route share
        the sends of a producer that is not busy enough to keep them all in flight.
        """
        n = len(key)
        start = self._turn.get(key, 0)
        self._turn[key] = (start + 1) % n
        ready = self.ready
        for i in range(n):
            ev = ready.get(key[(start + i) % n])
            if ev is not None:
                ev.set()

    def wake_all(self) -> None:
        for ev in self.ready.values():
            ev.set()

    async def _run(self, group: str) -> None:
        acc = self._acc
        opts = self._opts
        ready = self.ready[group]
        slot_freed = self._slot_freed[group]
        in_flight = self._in_flight
        linger_s = opts.linger_ms / 1000
        while True:
            while in_flight[group] >= opts.max_in_flight:
                slot_freed.clear()
                await slot_freed.wait()
            batch = acc.drain(group, opts.batch_messages_max, opts.batch_bytes_max)
            while batch is None:
                ready.clear()
                await ready.wait()
                if linger_s:
                    await asyncio.sleep(linger_s)  # the linger policy: let a batch fill for this long
                batch = acc.drain(group, opts.batch_messages_max, opts.batch_bytes_max)
            self._start(group, *batch, None)

    def sweep(self, now: float, *, age_s: float | None = None) -> None:
        """Write frames now for each group whose oldest queued message waited ``age_s`` (default
        ``EAGER_AFTER_S``, or the linger when longer): the caller has held the event loop since,
        so the sender loops could not run. ``age_s=0`` writes everything queued."""
        self._next_sweep_at = now + EAGER_AFTER_S
        if age_s is None:
            age_s = self._eager_after_s
        opts = self._opts
        acc = self._acc
        for group in self._in_flight:
            if group not in self._loops:
                continue
            while self._in_flight[group] < self._eager_frames_max:
                oldest = acc.oldest_enqueued_at(group)
                if oldest is None or now - oldest < age_s:
                    break
                bg = self._meta.target(group)
                try:
                    conn = self._pool.get(bg.address) if bg is not None else None
                except ConnectionLostError:
                    conn = None  # the producer is closing
                if conn is None or not conn.writable():
                    break  # the sender loop connects (or fails the batch) when it runs
                batch = acc.drain(group, opts.batch_messages_max, opts.batch_bytes_max)
                if batch is None:
                    break
                key, entries = batch
                self.stats.frames_sent += 1
                self.stats.messages_sent += len(entries)
                first = conn.write_request(RequestCode.SEND_MESSAGES, {}, [e[ENCODED] for e in entries])
                self._start(group, key, entries, first)

    def _start(self, group: str, key: RouteKey, entries: list[Entry], first: asyncio.Future[Frame] | None) -> None:
        """Track the frame of ``entries`` until it is answered, retried or failed."""
        self._in_flight[group] += 1
        task = asyncio.ensure_future(self._send(group, key, entries, first))
        self._batches.add(task)
        task.add_done_callback(self._batches.discard)
        task.add_done_callback(lambda _: self._freed(group))

    def _freed(self, group: str) -> None:
        self._in_flight[group] -= 1
        ev = self._slot_freed.get(group)
        if ev is not None:
            ev.set()

    async def _send(self, group: str, key: RouteKey, entries: list[Entry], first: asyncio.Future[Frame] | None) -> None:
        """One frame until answered: ``first`` is its response when the frame was already written."""
        loop = asyncio.get_running_loop()
        opts = self._opts
        stats = self.stats
        body = [e[ENCODED] for e in entries]
        deadline = min(e[ENQUEUED_AT] for e in entries) + opts.send_timeout_ms / 1000
        target = group
        # Once the frame may have been stored (written, then no answer or an error after the
        # write), it is sent again to the same broker group only: its duplicate window drops the
        # repeat, where another group would store the messages twice. Delay groups are exempt:
        # a copy kept by two of them is handed over twice, and the broker's window drops the
        # second (so a delay group's loss never stalls delayed sends).
        pins = not group.startswith(DELAY_TARGET_PREFIX)
        pinned = False
        backoff_s = opts.retry_backoff_ms / 1000
        try:
            while True:
                try:
                    if first is not None:
                        written, first = first, None
                        async with asyncio.timeout_at(deadline):
                            frame = await written
                    else:
                        bg = self._meta.target(target)
                        if bg is None:
                            raise ConnectionLostError(
                                f"{describe_target(target)} is not available (per the meta server)",
                                outcome_unknown=False,
                            )
                        conn = self._pool.get(bg.address)
                        stats.frames_sent += 1
                        stats.messages_sent += len(entries)
                        async with asyncio.timeout_at(deadline):
                            frame = await conn.request(RequestCode.SEND_MESSAGES, {}, body)
                except TimeoutError:
                    self.fail(
                        entries,
                        f"no answer from {describe_target(target)} within send_timeout_ms={opts.send_timeout_ms}; "
                        "the message may or may not be stored",
                        retriable=True,
                    )
                    return
                except (BrokerError, ConnectionLostError) as exc:
                    if not exc.retriable:
                        self.fail(entries, f"{describe_target(target)} refused the batch: {exc}", retriable=False)
                        return
                    if isinstance(exc, BrokerError) and exc.status == Status.NOT_MASTER:
                        self._meta.refresh_soon()
                    if loop.time() + backoff_s >= deadline:
                        self.fail(
                            entries,
                            f"not stored within send_timeout_ms={opts.send_timeout_ms}; "
                            f"last failure, from {describe_target(target)}: {exc}"
                            + ("; the message may or may not be stored" if pinned or exc.outcome_unknown else ""),
                            retriable=True,
                        )
                        return
                    pinned = pinned or (pins and exc.outcome_unknown)
                    log.debug("retrying a batch of %d after %s", len(entries), exc)
                    stats.retries += 1
                    if isinstance(exc, BrokerError) and exc.status == Status.THROTTLED:
                        # over the app's quota: wait as long as the broker asks (bounded by the
                        # send deadline), and send to the same group, whose bucket is the one in debt
                        wait_s = min(max(exc.retry_after_ms / 1000, backoff_s), deadline - loop.time())
                        await asyncio.sleep(max(wait_s, 0.0))
                        if loop.time() >= deadline:
                            self.fail(
                                entries,
                                f"not stored within send_timeout_ms={opts.send_timeout_ms}: {exc}",
                                retriable=True,
                            )
                            return
                        continue
                    await asyncio.sleep(backoff_s)  # retry backoff, bounded by the deadline above
                    backoff_s = min(backoff_s * 2, opts.retry_backoff_ms_max / 1000)
                    if not pinned:
                        if len(key) == 1 and self.widen is not None:
                            key = self.widen(target, entries)
                        target = self._next_group(key, target)
                    continue
                except AuthError as exc:
                    self.fail_with(entries, exc)  # as itself, never retried (the app lacks a right)
                    return
                except QmqError as exc:
                    self.fail(entries, f"{describe_target(target)} refused the batch: {exc}", retriable=False)
                    return
                try:
                    answer = answer_of(frame)
                except RemoteProtocolError as exc:
                    self.fail(
                        entries,
                        f"{describe_target(target)} answered the batch unreadably ({exc}); "
                        "the messages may or may not be stored",
                        retriable=False,
                    )
                    return
                self._complete(entries, answer, target)
                return
        except asyncio.CancelledError:
            self.fail(
                entries, "the producer closed while sending; the message may or may not be stored", retriable=True
            )
            raise
        finally:
            self._acc.release(entries)

    def _next_group(self, key: RouteKey, failed: str) -> str:
        """The route's next available group after ``failed`` (itself when it is the only one)."""
        names = [g.name for g in self._meta.available(key)]
        if not names:
            return failed
        if failed not in names:
            return names[0]
        return names[(names.index(failed) + 1) % len(names)]

    def fail(self, entries: list[Entry], reason: str, *, retriable: bool) -> None:
        """Fail the waiters of ``entries``, each with a SendError naming its message, and count them."""
        self.stats.messages_failed += len(entries)
        for e in entries:
            w = e[WAITER]
            if not w.done():
                with contextlib.suppress(*_INVALID_STATE):
                    w.set_exception(SendError(reason, e[MESSAGE_ID], retriable=retriable))

    def fail_with(self, entries: list[Entry], error: QmqError) -> None:
        """Fail the waiters of ``entries`` with ``error`` itself (an AuthError), and count them."""
        self.stats.messages_failed += len(entries)
        for e in entries:
            w = e[WAITER]
            if not w.done():
                with contextlib.suppress(*_INVALID_STATE):
                    w.set_exception(error)

    def _complete(self, entries: list[Entry], answer: dict[str, object], group: str) -> None:
        errors = answer.get("errors") or []
        failed: dict[int, tuple[int, str]] = {}
        if isinstance(errors, list):
            for item in errors:
                if isinstance(item, list) and len(item) == 3 and isinstance(item[0], int):
                    failed[item[0]] = (int(item[1]), str(item[2]))
                else:
                    log.warning("broker group %s sent a malformed send error %r", group, item)
        dups = answer.get("duplicates", 0)
        stats = self.stats
        stats.duplicates += dups if isinstance(dups, int) else 0
        stats.messages_stored += len(entries) - len(failed)
        stats.messages_failed += len(failed)
        for i, e in enumerate(entries):
            w = e[WAITER]
            if w.done():
                continue
            try:
                if failed and i in failed:
                    status, text = failed[i]
                    w.set_exception(
                        SendError(
                            f"{describe_target(group)} refused it: {status_name(status)}: {text}",
                            e[MESSAGE_ID],
                            retriable=False,
                        )
                    )
                else:
                    w.set_result(None)
            except _INVALID_STATE:
                pass  # cancelled by its caller meanwhile (another thread, in the blocking SDK)

    async def _expire_loop(self) -> None:
        loop = asyncio.get_running_loop()
        timeout_s = self._opts.send_timeout_ms / 1000
        period_s = min(timeout_s / 4, _EXPIRE_PERIOD_S_MAX)
        while True:
            await asyncio.sleep(period_s)  # periodic housekeeping, not a readiness wait
            expired = self._acc.expire(loop.time() - timeout_s)
            if not expired:
                continue
            by_place: dict[RouteKey | str, list[Entry]] = {}
            for where, entry in expired:
                by_place.setdefault(where, []).append(entry)
            for where, entries in by_place.items():
                if isinstance(where, str):
                    why = f"no broker group was available for subject {where!r}"
                else:
                    why = f"none of {', '.join(map(describe_target, where))} of its route was available"
                self.fail(
                    entries, f"not sent within send_timeout_ms={self._opts.send_timeout_ms}: {why}", retriable=True
                )
                self._acc.release(entries)

    async def connect(self, groups: Iterable[str]) -> None:
        """Connect to the available ones of ``groups`` now (best effort: a send tries again)."""
        targets = self._meta.available(groups)
        results = await asyncio.gather(
            *(self._pool.get(g.address).request(RequestCode.PING, {}) for g in targets), return_exceptions=True
        )
        for g, result in zip(targets, results, strict=True):
            if isinstance(result, BaseException):
                log.debug("preparing %s: %s", describe_target(g.name), result)

    async def close(self) -> None:
        """Stop the loops and the expiry; cancel the frames still in flight (their messages fail)."""
        loops, self._loops = list(self._loops.values()), {}
        if self._expirer is not None:
            loops.append(self._expirer)
        for t in loops:
            t.cancel()
        batches = list(self._batches)
        for t in batches:
            t.cancel()
        await asyncio.gather(*loops, *batches, return_exceptions=True)
