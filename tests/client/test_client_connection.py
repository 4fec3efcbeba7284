"""The SDK's connection to a broker against a real `qmq standalone`: requests are written in
the order they were made, also when some had to wait."""

from __future__ import annotations

import asyncio

import pytest

from qmq.client.connection import Connection
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.testing import ReadyProcess

pytestmark = pytest.mark.integration


async def _written_order(futures: list[asyncio.Future[Frame]]) -> list[int]:
    """Indexes of ``futures`` in the order their requests were written (request ids ascend)."""
    frames = await asyncio.gather(*futures)
    return sorted(range(len(frames)), key=lambda i: frames[i].request_id)


async def test_a_request_that_waited_for_the_socket_is_not_overtaken_by_a_later_one(
    shared_standalone: ReadyProcess,
) -> None:
    conn = Connection(shared_standalone.ready["broker"], connect_timeout_ms=5000)
    try:
        await conn.request(RequestCode.PING, {})  # connected
        p = conn._proto
        assert p is not None
        p.pause_writing()  # as the transport does when its buffer passes the high mark
        first = asyncio.ensure_future(conn.start_request(RequestCode.PING, {}))
        await asyncio.sleep(0)  # it is waiting for the socket to drain
        assert not first.done()
        p.resume_writing()  # wakes it, a loop turn or two from now
        assert not conn.writable()  # an earlier request still waits to be written
        second = asyncio.ensure_future(conn.start_request(RequestCode.PING, {}))
        answers = await asyncio.gather(first, second)
        assert await _written_order(answers) == [0, 1]
        assert conn.writable()
    finally:
        await conn.close()


async def test_requests_made_while_connecting_are_written_in_the_order_made(shared_standalone: ReadyProcess) -> None:
    conn = Connection(shared_standalone.ready["broker"], connect_timeout_ms=5000)
    try:
        starts = [asyncio.ensure_future(conn.start_request(RequestCode.PING, {})) for _ in range(3)]
        await asyncio.sleep(0)  # they start: the first connects, the others wait
        connecting = conn._connecting
        assert connecting is not None
        await connecting  # woken before the waiters, which wait through a shield
        # connected, the waiters not yet woken: a request made now goes after them
        last = await conn.start_request(RequestCode.PING, {})
        answers = [*await asyncio.gather(*starts), last]
        assert await _written_order(answers) == [0, 1, 2, 3]
    finally:
        await conn.close()
