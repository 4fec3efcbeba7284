"""The SDK's connection to a broker against a real `qmq standalone`: requests are written in
the order they were made, also when some had to wait; a broker that shuts down says which
requests it never read, so the SDK knows those were not carried out."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from qmq import ConnectionLostError
from qmq.client.connection import Connection
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.testing import ReadyProcess, running_standalone

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


async def test_a_request_written_after_the_broker_shut_down_is_known_not_carried_out(tmp_path: Path) -> None:
    with running_standalone(tmp_path / "qmq-data") as standalone:
        conn = Connection(standalone.ready["broker"], connect_timeout_ms=5000)
        try:
            await conn.request(RequestCode.PING, {})
            # The broker stops while this client's loop does not run: its goodbye and the end of
            # the connection wait unread, and the connection still looks writable.
            standalone.stop()
            assert conn.writable()
            late = conn.write_request(RequestCode.SEND_MESSAGES, {}, [])
            with pytest.raises(ConnectionLostError) as info:
                await late
            # Without the goodbye's count it could have been read before the close (outcome
            # unknown: a producer would then send it to this broker group only, until it returns).
            assert not info.value.outcome_unknown, str(info.value)
            assert "SHUTTING_DOWN" in str(info.value)
            assert "before it read this request" in str(info.value)
        finally:
            await conn.close()
