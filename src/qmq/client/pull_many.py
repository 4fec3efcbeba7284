"""One pull of many subjects: a PULL_MANY request per broker group (broker/pull_many.py).

A consumer of many subjects asks each broker group once for all the subjects it pulls there,
each subject's pending acks riding along as they do on a PULL, instead of one PULL per
subject. A broker group that does not know PULL_MANY (older brokers answer UNKNOWN_COMMAND)
is remembered and pulled subject by subject, as are ordered subscriptions (the broker serves
those by PULL only). Nothing waits: a subject with nothing gets an empty batch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from typing import Any

from qmq.client.acks import AckTracker
from qmq.client.connection import ConnectionPool
from qmq.client.meta import BrokerGroup
from qmq.client.pull_consumer import PullConsumer
from qmq.client.puller import ConsumerContext, SubjectPuller
from qmq.client.received import BatchBase
from qmq.common.errors import BrokerError, ConnectionLostError, QmqError
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import RemoteProtocolError

log = logging.getLogger(__name__)

# subjects in one PULL_MANY request (the broker takes up to 2,000); more go in further requests
ENTRIES_PER_REQUEST_MAX = 1_000

_Entry = tuple[int, SubjectPuller[Any], AckTracker, list[list[int]]]


async def pull_many(
    pull_consumers: Sequence[PullConsumer], max_messages: int, per_subject_max: int
) -> list[BatchBase[Any]]:
    """A batch for each of ``pull_consumers`` (in order; empty for those that got nothing): up to
    ``per_subject_max`` messages of each subject and ``max_messages`` in all per request."""
    out: list[BatchBase[Any] | None] = [None] * len(pull_consumers)
    if not pull_consumers:
        return []
    ctx = pull_consumers[0].puller.context
    meta, pool = ctx.started()
    by_group: dict[str, tuple[BrokerGroup, list[int]]] = {}
    one_by_one: list[int] = []
    for i, pc in enumerate(pull_consumers):
        p = pc.puller
        stashed = p.stashed(per_subject_max)
        if stashed is not None:
            out[i] = stashed
            continue
        groups = meta.available(await meta.resolve(p.subject))
        if not groups:
            out[i] = p.empty()  # nowhere to pull it now; the next call looks again
            continue
        bg = p.next_group(groups)
        if p.context is not ctx or p.subscription.ordered or bg.name in ctx.no_pull_many:
            one_by_one.append(i)
        else:
            by_group.setdefault(bg.name, (bg, []))[1].append(i)
    requests = [
        (bg, indexes[k : k + ENTRIES_PER_REQUEST_MAX])
        for bg, indexes in by_group.values()
        for k in range(0, len(indexes), ENTRIES_PER_REQUEST_MAX)
    ]
    refused = await asyncio.gather(
        *(_request(ctx, pool, bg, idx, pull_consumers, max_messages, per_subject_max, out) for bg, idx in requests)
    )
    one_by_one.extend(i for indexes in refused for i in indexes)
    if one_by_one:
        batches = await asyncio.gather(*(pull_consumers[i].pull(per_subject_max, 0) for i in one_by_one))
        for i, batch in zip(one_by_one, batches, strict=True):
            out[i] = batch
    return [b if b is not None else pull_consumers[i].puller.empty() for i, b in enumerate(out)]


async def _request(
    ctx: ConsumerContext,
    pool: ConnectionPool,
    bg: BrokerGroup,
    indexes: list[int],
    pull_consumers: Sequence[PullConsumer],
    max_messages: int,
    per_subject_max: int,
    out: list[BatchBase[Any] | None],
) -> list[int]:
    """One PULL_MANY to ``bg``; fills ``out``. Returns the indexes to pull one by one instead
    (all of them when ``bg`` does not know PULL_MANY)."""
    taken: list[_Entry] = []
    entries: list[dict[str, Any]] = []
    for i in indexes:
        p = pull_consumers[i].puller
        entry, tracker, ranges = p.many_entry(bg, per_subject_max)
        entries.append(entry)
        taken.append((i, p, tracker, ranges))
    header = {"consumer_id": ctx.consumer_id, "max": max_messages, "pulls": entries}
    conn = pool.get(bg.address)
    try:
        async with asyncio.timeout(ctx.options.request_timeout_ms / 1000):
            frame = await conn.request(RequestCode.PULL_MANY, header, with_session=True)
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
    results = frame.header.get("results")
    if not isinstance(results, list) or len(results) != len(taken):
        conn.abort()
        raise RemoteProtocolError(f"a PULL_MANY answer of broker group {bg.name} has no result for each subject")
    if frame.header.get("acks_error") is not None:
        for _i, _p, tracker, ranges in taken:
            tracker.requeue(ranges)  # recorded on the master but not replicated: sent again later
    body = frame.body if isinstance(frame.body, bytes) else bytes(frame.body)
    at = 0
    for (i, p, tracker, ranges), result in zip(taken, results, strict=True):
        if not isinstance(result, dict) or "error" in result:
            tracker.requeue(ranges)
            text = result.get("error") if isinstance(result, dict) else result
            log.warning("broker group %s refused a pull of %r in group %r: %s", bg.name, p.subject, p.group, text)
            continue
        size = result.get("bytes")
        if not isinstance(size, int) or size < 0 or at + size > len(body):
            conn.abort()
            raise RemoteProtocolError(
                f"a PULL_MANY answer of broker group {bg.name} gives {size!r} bytes to {p.subject!r}"
            )
        out[i] = p.parse_part(body[at : at + size], result.get("runs", []), tracker)
        at += size
    return []
