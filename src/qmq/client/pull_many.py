"""One pull of many subjects: a PULL_MANY request per broker group (broker/pull_many.py).

A consumer of many subjects asks each broker group once for all the subjects it pulls there,
each subject's pending acks riding along as they do on a PULL, instead of one PULL per
subject. A broker group that does not know PULL_MANY (older brokers answer UNKNOWN_COMMAND)
is remembered and pulled subject by subject, as are ordered subscriptions (the broker serves
those by PULL only). A consumer's retry subject rides along when it is due, as with ``pull``.
A call may wait (``timeout_ms``, the broker's long poll) when all its subjects go to one broker
group; otherwise nothing waits, and a subject with nothing gets an empty batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any

from qmq.client.acks import AckTracker
from qmq.client.connection import ConnectionPool
from qmq.client.meta import BrokerGroup
from qmq.client.pull_consumer import PullConsumer
from qmq.client.puller import ConsumerContext, SubjectPuller
from qmq.client.received import BatchBase, ParsedRecord
from qmq.common.errors import BrokerError, ConnectionLostError, QmqError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame
from qmq.protocol.packing import packb

log = logging.getLogger(__name__)

# subjects in one PULL_MANY request (the broker takes up to 2,000); more go in further requests
ENTRIES_PER_REQUEST_MAX = 1_000
# bytes of entries in one request's header: the frame's bound less room for the rest of it
_ENTRIES_BYTES_MAX = DEFAULT_LIMITS.frame_header_bytes_max - 4 * 1024

_Entry = tuple[int, SubjectPuller[Any], AckTracker, list[list[int]]]


async def pull_many(
    pull_consumers: Sequence[PullConsumer], max_messages: int, per_subject_max: int, timeout_ms: int = 0
) -> list[BatchBase[Any]]:
    """A batch for each of ``pull_consumers`` (in order; empty for those that got nothing): up to
    ``per_subject_max`` messages of each subject and ``max_messages`` in all per request. Each
    consumer's retry subject is looked at too, as ``pull`` does (every retry_pull_interval_ms, and
    again at once while it has messages), its messages first in the consumer's batch. With
    ``timeout_ms`` the broker waits that long for messages when none of the subjects has any; only
    when they all go in one request (one broker group), since a wait on one broker group would hold
    back what another has."""
    if not pull_consumers:
        return []
    ctx = pull_consumers[0].puller.context
    meta, pool = ctx.started()
    # what is pulled: each consumer's subject, and its retry subject when due; ``of[k]`` is the
    # consumer target ``k`` belongs to
    pullers: list[SubjectPuller[Any]] = []
    of: list[int] = []
    retries: list[int] = []  # targets that are retry subjects
    for i, pc in enumerate(pull_consumers):
        retry = pc.retry_due() if pc.puller.context is ctx else None
        if retry is not None:
            retries.append(len(pullers))
            pullers.append(retry)
            of.append(i)
        pullers.append(pc.puller)
        of.append(i)
    out: list[BatchBase[Any] | None] = [None] * len(pullers)
    by_group: dict[str, tuple[BrokerGroup, list[int]]] = {}
    one_by_one: list[int] = []
    # routes not known yet are asked for together (up to 256 subjects a request to the meta
    # server), not one request per subject as the loop below would
    unknown = {p.subject for p in pullers if meta.route(p.subject) is None}
    if len(unknown) > 1:
        await asyncio.gather(*(meta.resolve(s) for s in unknown))
    for k, p in enumerate(pullers):
        stashed = p.stashed(per_subject_max)
        if stashed is not None:
            out[k] = stashed
            continue
        groups = meta.available(await meta.resolve(p.subject))
        if not groups:
            out[k] = p.empty()  # nowhere to pull it now; the next call looks again
            continue
        bg = p.next_group(groups)
        if p.context is not ctx or p.subscription.ordered or bg.name in ctx.no_pull_many:
            one_by_one.append(k)
        else:
            by_group.setdefault(bg.name, (bg, []))[1].append(k)
    requests = [
        (bg, indexes[n : n + ENTRIES_PER_REQUEST_MAX])
        for bg, indexes in by_group.values()
        for n in range(0, len(indexes), ENTRIES_PER_REQUEST_MAX)
    ]
    waits = len(requests) == 1 and not one_by_one and all(b is None for b in out)
    wait_ms = timeout_ms if waits else 0
    refused = await asyncio.gather(
        *(_request(ctx, pool, bg, idx, pullers, max_messages, per_subject_max, out, wait_ms) for bg, idx in requests)
    )
    one_by_one.extend(k for indexes in refused for k in indexes)
    if one_by_one:
        retry_set = set(retries)
        # a consumer's own subject through its pull consumer (an ordered one holds keys), a retry
        # subject through its puller
        batches = await asyncio.gather(
            *(
                (pullers[k] if k in retry_set else pull_consumers[of[k]]).pull(per_subject_max, 0)
                for k in one_by_one
            )
        )
        for k, batch in zip(one_by_one, batches, strict=True):
            out[k] = batch
    for k in retries:
        pull_consumers[of[k]].retry_looked(bool(out[k]))
    merged: list[BatchBase[Any]] = [pc.puller.empty() for pc in pull_consumers]
    for k, got in enumerate(out):
        if got:
            merged[of[k]].extend(got)
    return merged


async def _request(
    ctx: ConsumerContext,
    pool: ConnectionPool,
    bg: BrokerGroup,
    indexes: list[int],
    pullers: Sequence[SubjectPuller[Any]],
    max_messages: int,
    per_subject_max: int,
    out: list[BatchBase[Any] | None],
    wait_ms: int,
) -> list[int]:
    """PULL_MANY to ``bg`` for ``indexes``: one request, or several at once when their entries
    would not fit one frame's header (none of them then waits: a long poll would hold back what
    the others got); fills ``out``. Returns the indexes to pull one by one instead (all of them
    when ``bg`` does not know PULL_MANY)."""
    parts = []
    while indexes:
        taken, entries, indexes = _entries(bg, indexes, pullers, per_subject_max)
        parts.append((taken, entries))
    wait_ms = wait_ms if len(parts) == 1 else 0
    refused = await asyncio.gather(
        *(_request_one(ctx, pool, bg, taken, entries, max_messages, out, wait_ms) for taken, entries in parts)
    )
    return [k for indexes in refused for k in indexes]


def _entries(
    bg: BrokerGroup, indexes: list[int], pullers: Sequence[SubjectPuller[Any]], per_subject_max: int
) -> tuple[list[_Entry], list[dict[str, Any]], list[int]]:
    """The entries of ``indexes`` (with their pending acks, taken) that fit one request's header,
    and the indexes left for the next: a thousand subjects of long names, or with many acks
    each, would pass the frame's bound (``frame_header_bytes_max``) and fail the whole pull."""
    taken: list[_Entry] = []
    entries: list[dict[str, Any]] = []
    used = 0
    for n, i in enumerate(indexes):
        p = pullers[i]
        entry, tracker, ranges = p.many_entry(bg, per_subject_max)
        size = len(packb(entry))
        if entries and used + size > _ENTRIES_BYTES_MAX:
            tracker.requeue(ranges)
            return taken, entries, indexes[n:]
        used += size
        entries.append(entry)
        taken.append((i, p, tracker, ranges))
    return taken, entries, []


async def _request_one(
    ctx: ConsumerContext,
    pool: ConnectionPool,
    bg: BrokerGroup,
    taken: list[_Entry],
    entries: list[dict[str, Any]],
    max_messages: int,
    out: list[BatchBase[Any] | None],
    wait_ms: int,
) -> list[int]:
    """One PULL_MANY of ``entries``; fills ``out``. Returns the indexes to pull one by one."""
    indexes = [i for i, _p, _t, _r in taken]
    # share: an entry whose records are an earlier entry's gets them by reference, not again
    header: dict[str, Any] = {"consumer_id": ctx.consumer_id, "max": max_messages, "pulls": entries, "share": True}
    if wait_ms:
        header["timeout_ms"] = wait_ms
    conn = pool.get(bg.address)
    fut: asyncio.Future[Frame] | None = None
    try:
        fut = await conn.start_request(RequestCode.PULL_MANY, header, with_session=True)
        fut.add_done_callback(_retrieve)
        try:
            async with asyncio.timeout((wait_ms + ctx.options.request_timeout_ms) / 1000):
                frame = await asyncio.shield(fut)
        except (asyncio.CancelledError, TimeoutError):
            # the caller gave up (while the broker waited, say), or the answer is late: what it
            # hands out is this consumer's now, kept for its next pulls rather than dropped
            if not fut.done():
                fut.add_done_callback(lambda f: _keep_late(f, taken))
            raise
    except asyncio.CancelledError:
        if fut is None:  # cancelled before the request was written: its acks go with a later one
            for _i, _p, tracker, ranges in taken:
                tracker.requeue(ranges)
        raise
    except BaseException as exc:
        for _i, _p, tracker, ranges in taken:
            tracker.requeue(ranges)
        if isinstance(exc, BrokerError) and exc.status == Status.UNKNOWN_COMMAND:
            ctx.no_pull_many.add(bg.name)
            return indexes
        if isinstance(exc, (ConnectionLostError, TimeoutError)) or (isinstance(exc, QmqError) and exc.retriable):
            log.debug("a pull of %d subjects from broker group %s failed: %s", len(indexes), bg.name, exc)
            return []  # empty batches: the next call asks again
        raise
    for i, batch in _parts(frame, taken, bg.name, conn.abort):
        out[i] = batch
    return []


def _retrieve(fut: asyncio.Future[Frame]) -> None:
    if not fut.cancelled():
        fut.exception()


def _parts(
    frame: Frame, taken: list[_Entry], broker_group: str, abort: Callable[[], None]
) -> list[tuple[int, BatchBase[Any]]]:
    """The batch of each entry of a PULL_MANY answer (those the broker refused get none, their
    acks requeued); a malformed answer drops the connection and raises."""
    results = frame.header.get("results")
    if not isinstance(results, list) or len(results) != len(taken):
        abort()
        raise RemoteProtocolError(f"a PULL_MANY answer of broker group {broker_group} has no result for each subject")
    acks_error = frame.header.get("acks_error") is not None
    if acks_error:
        for _i, _p, tracker, ranges in taken:
            tracker.requeue(ranges)  # recorded on the master but not replicated: sent again later
    body = frame.body if isinstance(frame.body, bytes) else bytes(frame.body)
    at = 0
    batches: list[tuple[int, BatchBase[Any]]] = []
    # the part of the body and the records of each result that later ones say they share
    referred = {r["same"] for r in results if isinstance(r, dict) and isinstance(r.get("same"), int)}
    parts: dict[int, tuple[bytes, list[ParsedRecord]]] = {}
    for j, ((i, p, tracker, ranges), result) in enumerate(zip(taken, results, strict=True)):
        if not isinstance(result, dict) or "error" in result:
            tracker.requeue(ranges)
            text = result.get("error") if isinstance(result, dict) else result
            log.warning("broker group %s refused a pull of %r in group %r: %s", broker_group, p.subject, p.group, text)
            continue
        size = result.get("bytes")
        same = result.get("same")
        # a result that shares an earlier one's records brings no bytes of its own
        shared = same is None or (isinstance(same, int) and same in parts and size == 0)
        if not isinstance(size, int) or size < 0 or at + size > len(body) or not shared:
            abort()
            what = f"{size!r} bytes" if same is None else f"the records of result {same!r}"
            raise RemoteProtocolError(
                f"a PULL_MANY answer of broker group {broker_group} gives {what} to {p.subject!r}"
            )
        if ranges and not acks_error:
            tracker.count_unheld(result.get("acks_unheld"))
        runs = result.get("runs", [])
        if same is not None:
            batches.append((i, p.share_part(*parts[same], runs, tracker)))
            continue
        part = body[at : at + size]
        if j in referred:
            records: list[ParsedRecord] = []
            batches.append((i, p.parse_part(part, runs, tracker, records)))
            parts[j] = (part, records)
        else:
            batches.append((i, p.parse_part(part, runs, tracker)))
        at += size
    return batches


def _keep_late(fut: asyncio.Future[Frame], taken: list[_Entry]) -> None:
    """A PULL_MANY answered after its caller had gone: each subject's batch kept by its puller."""
    if fut.cancelled() or fut.exception() is not None:
        return
    try:
        parts = _parts(fut.result(), taken, "(late answer)", lambda: None)
    except RemoteProtocolError as exc:
        log.error("a late PULL_MANY answer is malformed: %s", exc)
        return
    trackers = {i: tracker for i, _p, tracker, _r in taken}
    pullers = {i: p for i, p, _t, _r in taken}
    for i, batch in parts:
        pullers[i].keep(batch, trackers[i])
