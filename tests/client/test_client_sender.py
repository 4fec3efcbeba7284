"""The producer's sender alone, with no broker group available: what it was given waits in the
buffer, and what waited past send_timeout_ms fails, saying where it could not go."""

from __future__ import annotations

import asyncio

import pytest

from qmq import BufferFullError, SendError
from qmq.client.accumulator import Accumulator, Entry
from qmq.client.connection import ConnectionPool
from qmq.client.meta import MetaClient
from qmq.client.options import ProducerOptions
from qmq.client.sender import ProducerStats, Sender

_SEND_TIMEOUT_MS = 40


def _entry(mid: str) -> tuple[Entry, asyncio.Future[None]]:
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[None] = loop.create_future()
    return (b"x" * 10, fut, mid, loop.time(), 0, False), fut


async def test_what_waited_past_send_timeout_fails_with_where_it_could_not_go() -> None:
    acc = Accumulator(messages_max=10, bytes_max=1 << 20)
    stats = ProducerStats()
    # Never started: it knows no broker group, so no sender loop runs.
    meta = MetaClient("http://127.0.0.1:9/meta/address", timeout_ms=1000)
    sender = Sender(
        acc, meta, ConnectionPool(connect_timeout_ms=1000), ProducerOptions(send_timeout_ms=_SEND_TIMEOUT_MS), stats
    )
    sender.start()
    try:
        queued, queued_fut = _entry("m1")
        held, held_fut = _entry("m2")
        sender.submit(("b1", "b2"), queued)
        acc.hold("s", held)
        assert acc.count == 2
        with pytest.raises(SendError, match=f"not sent within send_timeout_ms={_SEND_TIMEOUT_MS}") as info:
            await asyncio.wait_for(queued_fut, 5)
        assert "none of broker group b1, broker group b2 of its route was available" in str(info.value)
        assert info.value.message_id == "m1"
        assert info.value.retriable
        with pytest.raises(SendError, match="no broker group was available for subject 's'"):
            await asyncio.wait_for(held_fut, 5)
        assert stats.messages_failed == 2
        assert acc.count == 0  # their room is free again
    finally:
        await sender.close()


async def test_a_full_buffer_refuses_a_submit() -> None:
    acc = Accumulator(messages_max=1, bytes_max=1 << 20)
    meta = MetaClient("http://127.0.0.1:9/meta/address", timeout_ms=1000)
    sender = Sender(acc, meta, ConnectionPool(connect_timeout_ms=1000), ProducerOptions(), ProducerStats())
    sender.submit(("b1",), _entry("m1")[0])
    with pytest.raises(BufferFullError, match="buffer_messages_max=1"):
        sender.submit(("b1",), _entry("m2")[0])
    await sender.close()
