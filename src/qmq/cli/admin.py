"""Administrative requests of the CLI: ask every broker group of a meta server and gather the
answers, or open a connection to each for a listing read page by page (``qmq.client.pages``)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from qmq.cli.auth_commands import cli_authorization, cli_credentials, cli_tls
from qmq.client.connection import Connection
from qmq.client.meta import MetaClient
from qmq.common.errors import BrokerError, NoBrokerError, QmqError
from qmq.protocol.answers import answer_of

_TIMEOUT_MS = 10_000
# what a broker answers LAG for a group that has never pulled a subject there, and for a
# subject it does not know at all (qmq.broker.listings)
_NEVER_PULLED = "has never pulled"
_UNKNOWN_SUBJECT = "is unknown here"


@asynccontextmanager
async def broker_connections(meta_server: str) -> AsyncIterator[dict[str, Connection]]:
    """``{broker group: a connection to its master}`` of every available group, closed after."""
    meta = MetaClient(meta_server, timeout_ms=_TIMEOUT_MS, authorization=cli_authorization(), ssl=cli_tls(meta_server))
    await meta.start()
    try:
        groups = dict(meta.groups)
    finally:
        await meta.close()
    if not groups:
        raise NoBrokerError(f"the meta server {meta_server} knows no available broker group; is a broker running?")
    credentials, tls = cli_credentials(), cli_tls(meta_server)
    conns = {
        name: Connection(g.address, connect_timeout_ms=_TIMEOUT_MS, credentials=credentials, ssl=tls)
        for name, g in sorted(groups.items())
    }
    try:
        yield conns
    finally:
        await asyncio.gather(*(c.close() for c in conns.values()))


async def ask_every_broker(meta_server: str, code: int, header: dict[str, Any]) -> dict[str, dict[str, Any] | QmqError]:
    """``{broker group: its answer or the error it answered}`` of one request to every available
    group (the answer of a paged request is its first page)."""
    async with broker_connections(meta_server) as conns:
        return await ask_each(conns, code, header)


async def ask_each(
    conns: dict[str, Connection], code: int, header: dict[str, Any]
) -> dict[str, dict[str, Any] | QmqError]:
    """``{name: its answer or the error it answered}`` of one request on each of ``conns``, at once."""
    results = await asyncio.gather(*(c.request(code, dict(header)) for c in conns.values()), return_exceptions=True)
    out: dict[str, dict[str, Any] | QmqError] = {}
    for name, result in zip(conns, results, strict=True):
        if isinstance(result, QmqError):
            out[name] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            try:
                out[name] = answer_of(result)
            except QmqError as exc:
                out[name] = exc
    return out


def is_never_pulled(error: QmqError) -> bool:
    """A broker's LAG refusal for a group that has never pulled the subject there, or for a
    subject it does not know."""
    return isinstance(error, BrokerError) and (_NEVER_PULLED in str(error) or _UNKNOWN_SUBJECT in str(error))


def is_unknown_subject(error: QmqError) -> bool:
    """A broker's LAG refusal for a subject it holds no message and no consumer group of."""
    return isinstance(error, BrokerError) and _UNKNOWN_SUBJECT in str(error)
