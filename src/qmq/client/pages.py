"""Listings read page by page: a paged request (SUBJECTS, LAG, DEAD_LETTERS; docs/protocol.md)
asked again with the last page's ``next`` as ``after`` until a page comes without one."""

from __future__ import annotations

from collections.abc import AsyncGenerator
from typing import Any

from qmq.client.connection import Connection
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.protocol.errors import RemoteProtocolError


async def pages(conn: Connection, code: int, header: dict[str, Any]) -> AsyncGenerator[dict[str, Any], None]:
    """The answer documents of a listing, page after page, from the first."""
    after: Any = header.get("after")
    while True:
        asked = header if after is None else {**header, "after": after}
        doc = answer_of(await conn.request(code, asked))
        yield doc
        following = doc.get("next")
        if following is None:
            return
        if following == after:  # a page that does not move on would be asked for ever
            raise RemoteProtocolError(
                f"{conn.address} answered {RequestCode(code).name} with the cursor it was given "
                f"({following!r:.200}); the listing does not move on"
            )
        after = following


async def subjects(conn: Connection) -> AsyncGenerator[dict[str, Any], None]:
    """Every subject of one broker, by name: ``{"subject", "messages", "first", "groups"}``,
    a subject whose groups ran over several pages put back together."""
    held: dict[str, Any] | None = None
    async for doc in pages(conn, RequestCode.SUBJECTS, {}):
        for item in doc.get("subjects", []):
            if held is not None and item.get("subject") == held["subject"]:
                held["groups"].extend(item.get("groups", []))
                continue
            if held is not None:
                yield held
            held = {**item, "groups": list(item.get("groups", []))}
    if held is not None:
        yield held
