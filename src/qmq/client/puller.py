"""PULL and ACK requests for one subject as one consumer of one consumer group.

A subject may be routed to several broker groups; pulls go round robin among the available
ones, and acknowledgements go back to the broker group each message came from (one
``AckTracker`` per broker group). Pending acks ride on the next PULL to that broker group
(its ``ack`` key); ``flush_acks_together`` sends the rest, one ACK_MANY request per broker
group for every subject of the consumer.

A pull whose caller gave up (cancelled) may still be answered with messages the broker has
recorded as handed to this consumer; they are kept for the next pull rather than dropped.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, Generic

from qmq.client.acks import AckTracker
from qmq.client.connection import ConnectionPool
from qmq.client.meta import BrokerGroup, MetaClient
from qmq.client.options import ConnectOptions, ConsumerOptions, StartFrom
from qmq.client.received import BatchBase, M, ParsedRecord, make_records, parse_records, parse_runs
from qmq.client.subscription import Subscription
from qmq.common.errors import BrokerError, ConnectionLostError, NoBrokerError, QmqError, error_text
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame
from qmq.protocol.packing import packb

log = logging.getLogger(__name__)

# Batches answered to pulls whose caller had gone; beyond this the connection is dropped
# instead, so the broker re-delivers them to the next session.
_STASHED_BATCHES_MAX = 16
DEFAULT_SUBSCRIPTION = Subscription()


@dataclass(slots=True)
class ConsumerContext:
    """What every puller of one consumer shares."""

    app_code: str
    consumer_id: str
    options: ConsumerOptions
    connect_options: ConnectOptions
    on_nack: Callable[[Any, BaseException | None], Coroutine[Any, Any, None]]
    meta: MetaClient | None = None
    pool: ConnectionPool | None = None
    pullers: list[SubjectPuller[Any]] = field(default_factory=list)
    closed: bool = False
    # broker groups that answered PULL_MANY UNKNOWN_COMMAND (older brokers): pulled subject by subject
    no_pull_many: set[str] = field(default_factory=set)
    # the trackers with acks no request has taken yet (acks.py): what a flush sends
    with_acks: set[AckTracker] = field(default_factory=set)

    def started(self) -> tuple[MetaClient, ConnectionPool]:
        if self.meta is None or self.pool is None or self.closed:
            state = "closed" if self.closed else "not started"
            raise QmqError(f"the consumer is {state}; use `async with Consumer(...)` or `await consumer.start()`")
        return self.meta, self.pool


def _retrieve(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class SubjectPuller(Generic[M]):
    """Pulls ``subject`` for consumer group ``group`` and tracks the acks of what it returned."""

    def __init__(
        self,
        ctx: ConsumerContext,
        subject: str,
        group: str,
        start_from: StartFrom,
        origin_subject: str,
        make: type[M],
        batch_cls: type[BatchBase[M]],
        subscription: Subscription = DEFAULT_SUBSCRIPTION,
    ) -> None:
        self._ctx = ctx
        self.subscription = subscription
        self._pull_extra = subscription.pull_header()
        self.subject = subject
        self.group = group
        self.start_from = start_from
        # Messages of a %RETRY% subject are shown with the subject they were first sent to.
        self.origin_subject = origin_subject
        self._make = make
        self._batch_cls = batch_cls
        self.trackers: dict[str, AckTracker] = {}
        self._rr = 0
        self._lock = asyncio.Lock()
        self._stash: deque[BatchBase[M]] = deque()
        self._failures: dict[str, int] = {}
        self.pulls = 0
        self.messages = 0
        # what a nack of its messages calls (an ordered pull consumer retries in place instead)
        self.on_nack = ctx.on_nack
        # An ordered group's lease, per broker group: until when (loop time) the broker counts this
        # consumer live (the send time of its last answered pull + the lease the broker gave), and
        # what to call when a pull finds it may have lapsed (the broker may have moved its slots).
        self.fresh_until: dict[str, float] = {}
        self.lease_s: dict[str, float] = {}
        self.on_lapse: Callable[[str], None] | None = None
        # whether the consumer may leave its ordered group at close (None: yes; an ordered pull
        # consumer says no while the application holds a message it did not settle)
        self.may_leave: Callable[[], bool] | None = None
        ctx.pullers.append(self)

    def _tracker(self, broker_group: str) -> AckTracker:
        t = self.trackers.get(broker_group)
        if t is None:
            t = AckTracker(
                broker_group,
                self.subject,
                self.group,
                self.origin_subject,
                self.on_nack,
                self.subscription,
                listed=self._ctx.with_acks,
                owner=self,
            )
            t.loop = asyncio.get_running_loop()
            self.trackers[broker_group] = t
        return t

    async def pull(self, max_messages: int, timeout_ms: int) -> BatchBase[M]:
        """Up to ``max_messages``, waiting up to ``timeout_ms`` for the first; empty on timeout."""
        meta, _ = self._ctx.started()
        async with self._lock:
            if self._stash:
                return self._from_stash(max_messages)
            route = await meta.resolve(self.subject)
            groups = meta.available(route)
            if not groups:
                raise NoBrokerError(
                    f"no available broker group for subject {self.subject!r} (routed to: "
                    f"{', '.join(route) or 'none yet'}); is a broker running and registered with {meta.url}?"
                )
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout_ms / 1000
            n = len(groups)
            start = self._rr % n
            self._rr += 1
            last_error: QmqError | None = None
            failures = 0
            for i in range(n):
                bg = groups[(start + i) % n]
                # Every group but the last is asked without waiting; the last one long-polls.
                wait_ms = max(0, int((deadline - loop.time()) * 1000)) if i == n - 1 else 0
                try:
                    batch = await self._pull_one(bg, max_messages, wait_ms)
                except (ConnectionLostError, BrokerError) as exc:
                    if n == 1 or not exc.retriable:
                        raise
                    self._note_failure(bg.name, exc)
                    last_error = exc
                    failures += 1
                    continue
                self._failures.pop(bg.name, None)
                if batch:
                    return batch
            if last_error is not None and failures == n:
                raise last_error
            return self._batch_cls()

    # -- what a PULL_MANY of many subjects (client/pull_many.py) asks of each subject -----

    @property
    def context(self) -> ConsumerContext:
        return self._ctx

    def empty(self) -> BatchBase[M]:
        return self._batch_cls()

    def stashed(self, max_messages: int) -> BatchBase[M] | None:
        """A batch answered to a pull whose caller had gone, if one waits (see ``_stash_late``)."""
        return self._from_stash(max_messages) if self._stash else None

    def next_group(self, groups: list[BrokerGroup]) -> BrokerGroup:
        """The broker group to pull next among ``groups`` (round robin, as ``pull`` goes)."""
        bg = groups[self._rr % len(groups)]
        self._rr += 1
        return bg

    def many_entry(self, bg: BrokerGroup, max_messages: int) -> tuple[dict[str, Any], AckTracker, list[list[int]]]:
        """This subject's entry of a PULL_MANY to ``bg``, with its pending acks (taken: requeue
        them on the tracker when the request fails)."""
        tracker = self._tracker(bg.name)
        entry: dict[str, Any] = {
            "subject": self.subject,
            "group": self.group,
            "max": max_messages,
            "start": self.start_from,
            **self._pull_extra,
        }
        ranges = tracker.take() if self._ctx.options.acks_with_pulls else []
        if ranges:
            entry["ack"] = ranges
        return entry, tracker, ranges

    def parse_part(
        self, body: bytes, runs: object, tracker: AckTracker, kept: list[ParsedRecord] | None = None
    ) -> BatchBase[M]:
        """The batch of one PULL_MANY result: its ``runs`` and its part of the answer's body
        (with ``kept``: the records read, for ``share_part``)."""
        batch = self._batch_cls()
        parse_records(
            body, parse_runs(runs), self.origin_subject, tracker, batch, self._make, self._ctx.options.check_crc, kept
        )
        return self._counted(batch)

    def share_part(self, body: bytes, records: list[ParsedRecord], runs: object, tracker: AckTracker) -> BatchBase[M]:
        """The batch of a PULL_MANY result whose records are another result's (``records``, read
        from ``body`` by ``parse_part``): a fan-out's groups, the records carried once."""
        batch = self._batch_cls()
        make_records(body, records, parse_runs(runs), self.origin_subject, tracker, batch, self._make)
        return self._counted(batch)

    def _counted(self, batch: BatchBase[M]) -> BatchBase[M]:
        self.pulls += 1
        self.messages += len(batch)
        return batch

    def _note_failure(self, broker_group: str, exc: QmqError) -> None:
        # The other groups carry on; say so on the first failure and then rarely.
        count = self._failures.get(broker_group, 0) + 1
        self._failures[broker_group] = count
        if count == 1 or count % 100 == 0:
            log.warning(
                "pull of %r from broker group %s failed (%d time(s) in a row); pulling the other groups: %s",
                self.subject,
                broker_group,
                count,
                exc,
            )

    def _from_stash(self, max_messages: int) -> BatchBase[M]:
        batch = self._stash.popleft()
        if len(batch) > max_messages:
            rest = self._batch_cls(batch[max_messages:])
            del batch[max_messages:]
            self._stash.appendleft(rest)
        return batch

    async def _pull_one(self, bg: BrokerGroup, max_messages: int, timeout_ms: int) -> BatchBase[M]:
        _, pool = self._ctx.started()
        ctx = self._ctx
        tracker = self._tracker(bg.name)
        conn = pool.get(bg.address)
        header: dict[str, Any] = {
            "subject": self.subject,
            "group": self.group,
            "consumer_id": ctx.consumer_id,
            "max": max_messages,
            "timeout_ms": timeout_ms,
            "start": self.start_from,
            **self._pull_extra,
        }
        ranges = tracker.take() if ctx.options.acks_with_pulls else []
        if ranges:
            header["ack"] = ranges
        sent_at = asyncio.get_running_loop().time()
        try:
            fut = await conn.start_request(RequestCode.PULL, header, with_session=True)
        except BaseException:
            tracker.requeue(ranges)
            raise
        fut.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout(timeout_ms / 1000 + ctx.options.request_timeout_ms / 1000):
                frame = await asyncio.shield(fut)
        except asyncio.CancelledError:
            if not fut.done():
                fut.add_done_callback(lambda f: self._stash_late(f, tracker))
            raise
        except TimeoutError:
            # A broker that does not answer a pull: a new connection is a new session, and
            # the broker re-delivers what this one may have been handed.
            conn.abort()
            raise ConnectionLostError(
                f"broker group {bg.name} ({bg.address}) did not answer a pull of {self.subject!r} within "
                f"{timeout_ms} ms + request_timeout_ms={ctx.options.request_timeout_ms}; reconnecting"
            ) from None
        except (ConnectionLostError, BrokerError):
            # refused (a broker whose store failed, no longer master) or never answered: the acks
            # it carried go with a later request (they repeat safely), never dropped unanswered
            tracker.requeue(ranges)
            raise
        acks_error = frame.header.get("acks_error")
        if ranges and acks_error is not None:
            # recorded on the master but not replicated: sent again with a later request
            log.debug("acks to broker group %s are sent again: %s", bg.name, acks_error)
            tracker.requeue(ranges)
        elif ranges:
            tracker.count_unheld(frame.header.get("acks_unheld"))
        lease_ms = frame.header.get("lease_ms")
        if isinstance(lease_ms, int) and not isinstance(lease_ms, bool):
            before = self.fresh_until.get(bg.name)
            self.lease_s[bg.name] = lease_ms / 1000
            self.fresh_until[bg.name] = max(before or 0.0, sent_at + lease_ms / 1000)
            if before is not None and sent_at >= before:
                # Silent past the lease: the broker may have moved this consumer's slots with the
                # messages it held. Drop what is queued from that broker group and start a new
                # session, in which the broker hands again whatever is still this consumer's.
                if self.on_lapse is not None:
                    self.on_lapse(bg.name)
                conn.abort()
                return self._batch_cls()
        try:
            batch = self._parse(frame, tracker)
        except RemoteProtocolError:
            conn.abort()
            raise
        self.pulls += 1
        self.messages += len(batch)
        return batch

    def _parse(self, frame: Frame, tracker: AckTracker) -> BatchBase[M]:
        runs = parse_runs(frame.header.get("runs", []))
        body = frame.body if isinstance(frame.body, bytes) else bytes(frame.body)
        batch = self._batch_cls()
        parse_records(body, runs, self.origin_subject, tracker, batch, self._make, self._ctx.options.check_crc)
        return batch

    def _stash_late(self, fut: asyncio.Future[Frame], tracker: AckTracker) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        try:
            batch = self._parse(fut.result(), tracker)
        except RemoteProtocolError as exc:
            log.error("late answer to a pull of %r is malformed: %s", self.subject, exc)
            return
        self.keep(batch, tracker)

    def keep(self, batch: BatchBase[M], tracker: AckTracker) -> None:
        """Keep ``batch``, answered to a pull whose caller had gone, for the next pull (at most
        ``_STASHED_BATCHES_MAX``; past that the connection is dropped, and the broker hands its
        messages again to the next session)."""
        if not batch:
            return
        if len(self._stash) >= _STASHED_BATCHES_MAX:
            log.warning(
                "dropping a late pull answer of %d messages of %r; they come back on reconnect",
                len(batch),
                self.subject,
            )
            meta, pool = self._ctx.meta, self._ctx.pool
            bg = meta.groups.get(tracker.broker_group) if meta is not None else None
            if bg is not None and pool is not None:
                pool.get(bg.address).abort()
            return
        self._stash.append(batch)

    def ack_entry(self, tracker: AckTracker) -> tuple[dict[str, Any], list[list[int]]] | None:
        """The pending acks of ``tracker`` as an ACK_MANY entry (taken: requeue them on failure)."""
        ranges = tracker.take()
        if not ranges:
            return None
        entry: dict[str, Any] = {"subject": self.subject, "group": self.group, "ranges": ranges}
        if self.subscription.broadcast:
            entry["broadcast"] = True
        return entry, ranges

    async def _send_acks(self, tracker: AckTracker) -> None:
        """One ACK request (for a broker that does not know ACK_MANY; see flush_acks_together)."""
        meta, pool = self._ctx.started()
        bg = meta.groups.get(tracker.broker_group)
        if bg is None:
            return  # kept pending until the broker group is available again
        ranges = tracker.take()
        if not ranges:
            return
        header: dict[str, Any] = {
            "subject": self.subject,
            "group": self.group,
            "consumer_id": self._ctx.consumer_id,
            "ranges": ranges,
        }
        if self.subscription.broadcast:
            header["broadcast"] = True
        try:
            async with asyncio.timeout(self._ctx.options.request_timeout_ms / 1000):
                frame = await pool.get(bg.address).request(RequestCode.ACK, header)
        except (ConnectionLostError, TimeoutError) as exc:
            tracker.requeue(ranges)
            log.debug("acks to broker group %s wait for the next request: %s", bg.name, exc)
            return
        except asyncio.CancelledError:
            tracker.requeue(ranges)
            raise
        except QmqError as exc:
            if exc.retriable:  # e.g. recorded but not yet replicated: sent again with a later request
                tracker.requeue(ranges)
                log.debug("acks to broker group %s are sent again: %s", bg.name, exc)
            else:
                log.error("broker group %s refused acks of %r/%s: %s", bg.name, self.subject, self.group, exc)
            return
        offset = frame.header.get("ack_offset")
        if isinstance(offset, int):
            tracker.ack_offset = offset
        tracker.count_unheld(frame.header.get("unheld"))


# One ACK_MANY request holds at most this many entries (the broker takes up to 10,000) and
# about this many header bytes, well inside frame_header_bytes_max (64 KiB).
_ACK_MANY_ENTRIES_MAX = 1_000
_ACK_MANY_HEADER_BYTES = 40 * 1024


async def flush_acks_together(ctx: ConsumerContext) -> None:
    """Send the consumer's pending acks with one ACK_MANY request per broker group (more when
    they would not fit one), rather than an ACK per subject; a broker that does not know
    ACK_MANY gets them one subject at a time. Raises the first failure after sending the rest.
    Only the trackers in ``ctx.with_acks`` are looked at; what could not be sent (a broker
    group unavailable, a request that failed) stays pending, listed for the next flush."""
    meta, pool = ctx.started()
    listed = ctx.with_acks
    trackers: list[AckTracker] = []
    while listed:
        trackers.append(listed.pop())  # one by one: an ack from another thread may add meanwhile
    by_group: dict[str, list[tuple[SubjectPuller[Any], AckTracker]]] = {}
    for tracker in trackers:
        if tracker.pending and tracker.broker_group in meta.groups:  # else kept for later
            by_group.setdefault(tracker.broker_group, []).append((tracker.owner, tracker))
    try:
        results = await asyncio.gather(
            *(_ack_group(ctx, pool, meta.groups[name], pairs) for name, pairs in by_group.items()),
            return_exceptions=True,
        )
    finally:
        for tracker in trackers:
            tracker.relist()
    for result in results:
        if isinstance(result, BaseException):
            raise result


_Taken = tuple["SubjectPuller[Any]", AckTracker, dict[str, Any], list[list[int]]]


def ack_many_chunks(
    pairs: list[tuple[SubjectPuller[Any], AckTracker]],
    entries_max: int = _ACK_MANY_ENTRIES_MAX,
    header_bytes: int = _ACK_MANY_HEADER_BYTES,
) -> list[list[_Taken]]:
    """Take the pending acks of ``pairs`` as ACK_MANY entries, cut into requests of at most
    ``entries_max`` entries and about ``header_bytes`` of header each."""
    chunks: list[list[_Taken]] = []
    chunk: list[_Taken] = []
    size = 0
    for p, tracker in pairs:
        taken = p.ack_entry(tracker)
        if taken is None:
            continue
        entry, ranges = taken
        entry_bytes = len(packb(entry))
        if chunk and (len(chunk) >= entries_max or size + entry_bytes > header_bytes):
            chunks.append(chunk)
            chunk, size = [], 0
        chunk.append((p, tracker, entry, ranges))
        size += entry_bytes
    if chunk:
        chunks.append(chunk)
    return chunks


async def _ack_group(
    ctx: ConsumerContext, pool: ConnectionPool, bg: BrokerGroup, pairs: list[tuple[SubjectPuller[Any], AckTracker]]
) -> None:
    # taken here, in the task that sends them: a task cancelled before it ran has taken nothing
    chunks = ack_many_chunks(pairs)
    for n, chunk in enumerate(chunks):
        try:
            await _ack_many(ctx, pool, bg, chunk)
        except BaseException:
            for later in chunks[n + 1 :]:
                _requeue(later)
            raise


def _requeue(taken: list[_Taken]) -> None:
    """Put taken acks back: a later flush or pull sends them."""
    for _p, tracker, _entry, ranges in taken:
        tracker.requeue(ranges)


async def _ack_many(ctx: ConsumerContext, pool: ConnectionPool, bg: BrokerGroup, taken: list[_Taken]) -> None:
    header = {"consumer_id": ctx.consumer_id, "acks": [entry for _p, _t, entry, _r in taken]}
    sent_at = asyncio.get_running_loop().time()
    try:
        async with asyncio.timeout(ctx.options.request_timeout_ms / 1000):
            frame = await pool.get(bg.address).request(RequestCode.ACK_MANY, header)
    except (ConnectionLostError, TimeoutError, asyncio.CancelledError) as exc:
        _requeue(taken)
        if isinstance(exc, asyncio.CancelledError):
            raise
        log.debug("acks to broker group %s wait for the next request: %s", bg.name, exc)
        return
    except BrokerError as exc:
        if exc.status == Status.UNKNOWN_COMMAND:  # a broker from before ACK_MANY: an ACK per subject
            _requeue(taken)
            await asyncio.gather(*(p._send_acks(tracker) for p, tracker, _e, _r in taken))
            return
        if exc.retriable:  # e.g. no longer master: the acks go with a later request
            _requeue(taken)
        else:
            log.error("broker group %s refused the acks of %d subject(s): %s", bg.name, len(taken), exc)
        raise
    results = answer_of(frame).get("results")
    if not isinstance(results, list) or len(results) != len(taken):
        raise RemoteProtocolError(f"broker group {bg.name} answered ACK_MANY without one result per entry")
    for (p, tracker, _entry, _ranges), result in zip(taken, results, strict=True):
        offset = result.get("ack_offset") if isinstance(result, dict) else None
        if isinstance(offset, int):
            tracker.ack_offset = offset
            tracker.count_unheld(result.get("unheld"))
            lease_s = p.lease_s.get(bg.name)
            if lease_s is not None:  # an answered ack keeps an ordered consumer live, as a pull does
                p.fresh_until[bg.name] = max(p.fresh_until.get(bg.name, 0.0), sent_at + lease_s)
        else:
            error = result.get("error") if isinstance(result, dict) else result
            log.error("broker group %s refused acks of %r/%s: %s", bg.name, p.subject, p.group, error)


async def leave_ordered(ctx: ConsumerContext, pullers: list[SubjectPuller[Any]]) -> None:
    """Tell each broker group that answered an ordered pull of ``pullers`` that this consumer
    leaves (an ACK_MANY entry with ``leave``, sent once its handlers ended and its acks went): the
    broker hands its slots to the group's other consumers now, not when its lease runs out. A
    broker from before ``leave`` ignores it (the slots then move at the end of the lease)."""
    meta, pool = ctx.started()
    by_group: dict[str, list[dict[str, Any]]] = {}
    for p in pullers:
        if p.may_leave is not None and not p.may_leave():
            continue  # the application may still run a message of its keys: they wait out the lease
        for name in p.lease_s:  # only ordered pulls are answered with a lease
            by_group.setdefault(name, []).append(
                {"subject": p.subject, "group": p.group, "ranges": [], "leave": True}
            )
    requests = []
    for name, entries in by_group.items():
        bg = meta.groups.get(name)
        if bg is None:
            continue  # no master now: the slots move at the end of the lease
        for n in range(0, len(entries), _ACK_MANY_ENTRIES_MAX):
            header = {"consumer_id": ctx.consumer_id, "acks": entries[n : n + _ACK_MANY_ENTRIES_MAX]}
            requests.append(pool.get(bg.address).request(RequestCode.ACK_MANY, header))
    for result in await asyncio.gather(*requests, return_exceptions=True):
        if isinstance(result, Exception):  # the slots then move at the end of the lease
            log.debug("leaving an ordered group: %s", error_text(result))
