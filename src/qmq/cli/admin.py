"""Administrative requests of the CLI: ask every broker group of a meta server and gather the answers."""

from __future__ import annotations

import asyncio
from typing import Any

from qmq.client.connection import Connection
from qmq.client.meta import MetaClient
from qmq.common.errors import NoBrokerError, QmqError

_TIMEOUT_MS = 10_000


async def ask_every_broker(meta_server: str, code: int, header: dict[str, Any]) -> dict[str, dict[str, Any] | QmqError]:
    """``{broker group: response header or the error it answered}`` of one request to every available group."""
    meta = MetaClient(meta_server, timeout_ms=_TIMEOUT_MS)
    await meta.start()
    try:
        groups = dict(meta.groups)
    finally:
        await meta.close()
    if not groups:
        raise NoBrokerError(f"the meta server {meta_server} knows no available broker group; is a broker running?")
    conns = {name: Connection(g.address, connect_timeout_ms=_TIMEOUT_MS) for name, g in groups.items()}
    try:
        results = await asyncio.gather(*(c.request(code, dict(header)) for c in conns.values()), return_exceptions=True)
    finally:
        await asyncio.gather(*(c.close() for c in conns.values()))
    out: dict[str, dict[str, Any] | QmqError] = {}
    for name, result in zip(conns, results, strict=True):
        if isinstance(result, QmqError):
            out[name] = result
        elif isinstance(result, BaseException):
            raise result
        else:
            out[name] = result.header
    return out
