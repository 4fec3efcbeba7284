"""What the SDK asks of delay groups beside sends: cancelling a pending delay message.

Which delay group holds a message is not known to anyone but that group: the producer sends a
delay message to the available delay groups in turn, and to the next one when a send fails, so
a retried send may even sit in two. So a cancel asks every available delay group at once (the
meta server lists a handful; each answers from its own files) and the answers are put
together: cancelled if any group cancelled it, not cancelled if every group answered that it
holds nothing pending under that id, an error naming the groups that did not answer otherwise
(one of them may hold it).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

from qmq.client.connection import Connection
from qmq.client.message import check_message_id
from qmq.common.errors import NoBrokerError, QmqError, QmqTimeoutError
from qmq.protocol.codes import RequestCode


async def cancel_everywhere(conns: Mapping[str, Connection], message_id: str, timeout_ms: int) -> bool:
    """Ask every delay group of ``conns`` (``{group: connection}``) to cancel ``message_id``."""
    check_message_id(message_id)
    if not conns:
        raise NoBrokerError(
            f"no delay group is available to cancel message {message_id} in; is a delay server running?"
        )
    names = list(conns)
    results = await asyncio.gather(
        *(_ask(conns[name], message_id, timeout_ms) for name in names), return_exceptions=True
    )
    failed: dict[str, BaseException] = {}
    for name, result in zip(names, results, strict=True):
        if result is True:
            return True
        if isinstance(result, BaseException):
            if not isinstance(result, QmqError):
                raise result
            failed[name] = result
    if failed:
        why = "; ".join(f"delay group {name}: {exc}" for name, exc in sorted(failed.items()))
        error = QmqError(
            f"cannot tell whether message {message_id} was cancelled: {why}. The other delay groups hold "
            "nothing pending under that id; cancel again once those groups answer"
        )
        error.retriable = True
        raise error
    return False


async def _ask(conn: Connection, message_id: str, timeout_ms: int) -> bool:
    try:
        async with asyncio.timeout(timeout_ms / 1000):
            frame = await conn.request(RequestCode.CANCEL_DELAY, {"message_id": message_id})
    except TimeoutError:
        raise QmqTimeoutError(f"no answer within {timeout_ms} ms from {conn.address}") from None
    return frame.header.get("cancelled") is True
