"""What the SDK asks of delay groups beside sends: cancelling a pending delay message, and
listing the pending ones of a subject.

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
import heapq
from collections.abc import AsyncGenerator, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from qmq.client.connection import Connection
from qmq.client.message import check_message_id
from qmq.client.pages import pages
from qmq.common.errors import InvalidMessageError, NoBrokerError, QmqError, QmqTimeoutError
from qmq.protocol.codes import RequestCode

# items a DELAY_LIST page asks for (the server also ends a page at about 256 KiB)
_PAGE_ITEMS = 500


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


@dataclass(frozen=True, slots=True)
class PendingDelay:
    """A delay message a delay group holds and has not handed over (``Producer.delay_pending``)."""

    message_id: str
    subject: str
    due_ms: int  # when it is due, epoch milliseconds
    copy: int  # of a repeating message (1, 2, ...); 0 for a message sent once
    times: int  # its delivery attempt (above 1: a consumer's retry waiting for its back-off)
    created_ms: int
    tags: tuple[str, ...]
    size_bytes: int  # of the encoded message
    group: str  # the delay group that holds it

    @property
    def due_at(self) -> datetime:
        return datetime.fromtimestamp(self.due_ms / 1000, tz=UTC)


async def pending_everywhere(
    conns: Mapping[str, Connection], subject: str, from_ms: int, to_ms: int, page_items: int = _PAGE_ITEMS
) -> AsyncGenerator[PendingDelay, None]:
    """The pending messages of ``subject`` due in ``[from_ms, to_ms)`` on every delay group of
    ``conns``, by due time: each group's listing is read page by page (DELAY_LIST) and the
    groups' are merged, so memory holds one page per group."""
    if not conns:
        raise NoBrokerError(f"no delay group is available to list the pending messages of {subject} in")
    header = {"subject": subject, "from_ms": from_ms, "to_ms": to_ms, "limit": page_items}
    streams = {name: _listing(name, conn, header) for name, conn in conns.items()}
    heads: list[tuple[int, str, PendingDelay]] = []
    try:
        for name, stream in streams.items():
            first = await anext(stream, None)
            if first is not None:
                heapq.heappush(heads, (first.due_ms, name, first))
        while heads:
            _due, name, item = heapq.heappop(heads)
            yield item
            following = await anext(streams[name], None)
            if following is not None:
                heapq.heappush(heads, (following.due_ms, name, following))
    finally:
        for stream in streams.values():
            await stream.aclose()


async def _listing(group: str, conn: Connection, header: dict[str, Any]) -> AsyncGenerator[PendingDelay, None]:
    try:
        async for doc in pages(conn, RequestCode.DELAY_LIST, header):
            for item in doc.get("messages", []):
                yield PendingDelay(
                    str(item["message_id"]),
                    header["subject"],
                    int(item["due_ms"]),
                    int(item["copy"]),
                    int(item["times"]),
                    int(item["created_ms"]),
                    tuple(item.get("tags", ())),
                    int(item["bytes"]),
                    group,
                )
    except QmqError as exc:
        error = QmqError(f"delay group {group} could not list pending messages: {exc}")
        error.retriable = exc.retriable
        raise error from exc


def time_ms(what: str, when: datetime | float | None, default_ms: int) -> int:
    """An aware datetime or epoch seconds as epoch milliseconds (``default_ms`` for None)."""
    if when is None:
        return default_ms
    if isinstance(when, datetime):
        if when.tzinfo is None or when.utcoffset() is None:
            raise InvalidMessageError(f"{what} {when.isoformat()} has no time zone; pass an aware datetime")
        return int(when.timestamp() * 1000)
    if isinstance(when, bool) or not isinstance(when, int | float) or not 0 <= when < 1e12:
        raise InvalidMessageError(f"{what} = {when!r} is not an aware datetime or epoch seconds")
    return int(when * 1000)
