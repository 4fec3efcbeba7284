"""The consumer's lag metric (``qmq.consumer.lag``): while an application reads the SDK's
metrics, a consumer asks each broker group how far each of its listeners' groups is behind,
every ``LAG_REFRESH_S``, and keeps the sum over the broker groups for the metric's callback.

One LAG request per broker group and listener per refresh: small next to the pulls, and none at
all while no MeterProvider is configured.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable

from qmq.client import telemetry
from qmq.client.connection import ConnectionPool
from qmq.client.meta import MetaClient
from qmq.common.errors import QmqError
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode

log = logging.getLogger(__name__)

LAG_REFRESH_S = 15.0
# one refresh's answers are awaited at most this long; a slower broker group is left out this time
_ANSWER_TIMEOUT_S = 5.0


async def watch_lag(
    meta: MetaClient, pool: ConnectionPool, pairs: Callable[[], Iterable[tuple[str, str]]]
) -> None:
    """Refresh the lag of ``pairs()`` (``(subject, group)``) until cancelled."""
    known: set[tuple[str, str]] = set()
    try:
        while True:
            if telemetry.lag_wanted():
                wanted = set(pairs())
                for pair in known - wanted:
                    telemetry.set_lag(*pair, None)
                known = wanted
                for subject, group in sorted(wanted):
                    try:
                        telemetry.set_lag(subject, group, await _lag_of(meta, pool, subject, group))
                    except Exception as exc:  # one pair's failure must not stop the others
                        log.debug("lag of %s/%s: %s", subject, group, exc)
            await asyncio.sleep(LAG_REFRESH_S)  # the refresh period, not a readiness wait
    finally:
        for pair in known:
            telemetry.set_lag(*pair, None)


async def _lag_of(meta: MetaClient, pool: ConnectionPool, subject: str, group: str) -> int | None:
    """The group's backlog on the subject over every broker group that answered, or None when
    none knows the group there yet."""
    header = {"subject": subject, "group": group}
    conns = [pool.get(g.address) for g in list(meta.groups.values())]
    async with asyncio.timeout(_ANSWER_TIMEOUT_S):
        results = await asyncio.gather(
            *(c.request(RequestCode.LAG, dict(header)) for c in conns), return_exceptions=True
        )
    total: int | None = None
    for result in results:
        if isinstance(result, QmqError):
            continue  # a broker group that never saw the group pull, or is away
        if isinstance(result, BaseException):
            raise result
        doc = answer_of(result)
        total = (total or 0) + int(doc.get("backlog", 0))
    return total
