"""A server's connection alone, over a transport that records what is written: what a client
that does not read its replies, that never sends a request, or that comes past
connections_max can cost the server."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from qmq.common.config import DelayConfig
from qmq.common.limits import DEFAULT_LIMITS, MiB
from qmq.delay.metrics import DelayMetrics
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.serving.connection import ConnectionLimits, Connections, FrameConnection
from qmq.serving.server import FrameServer

_HIGH_BYTES = 64 * 1024  # the connection's write buffer high-water mark
_FRAMES_PER_TURN = 16  # frames one connection has handled per loop turn (qmq.serving.connection)


class FakeTransport:
    """Buffers every write as a client that does not read would make it; ``drain`` reads it all."""

    def __init__(self) -> None:
        self.protocol: FrameConnection | None = None
        self.buffered = bytearray()
        self.written = bytearray()  # what the client read, plus what is buffered
        self.high = self.low = 0
        self.paused = False  # writing, as the transport told the protocol
        self.reading = True
        self.eof = False
        self.closed = False
        self.aborted = False

    def get_extra_info(self, name: str) -> Any:
        return ("127.0.0.1", 40000) if name == "peername" else None

    def set_write_buffer_limits(self, high: int, low: int) -> None:
        self.high, self.low = high, low

    def get_write_buffer_size(self) -> int:
        return len(self.buffered)

    def write(self, data: bytes) -> None:
        assert not self.eof
        assert not self.closed
        self.buffered += data
        self.written += data
        if not self.paused and len(self.buffered) > self.high:
            self.paused = True
            assert self.protocol is not None
            self.protocol.pause_writing()

    def writelines(self, chunks: list[bytes]) -> None:
        self.write(b"".join(chunks))

    def drain(self) -> None:
        """The client reads everything."""
        self.buffered.clear()
        if self.paused:
            self.paused = False
            assert self.protocol is not None
            self.protocol.resume_writing()

    def pause_reading(self) -> None:
        self.reading = False

    def resume_reading(self) -> None:
        self.reading = True

    def can_write_eof(self) -> bool:
        return True

    def write_eof(self) -> None:
        self.eof = True

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def abort(self) -> None:
        self.aborted = self.closed = True
        self.buffered.clear()

    def frames(self) -> list[Frame]:
        decoder = FrameDecoder()
        decoder.receive_data(self.written)
        out = []
        while (frame := decoder.next_frame()) is not None:
            out.append(frame)
        return out


class Host:
    """A server whose handlers answer READ with ``answer_bytes`` and PING with nothing much."""

    limits = DEFAULT_LIMITS
    yield_after = frozenset({RequestCode.SEND_MESSAGES})

    def __init__(
        self, connections_max: int = 10, first_request_timeout_ms: int = 10_000, backlog_max: int = 32 * MiB
    ) -> None:
        self.refused: Counter[str] = Counter()
        self.dropped: Counter[str] = Counter()
        self.connections = Connections(
            ConnectionLimits(connections_max, first_request_timeout_ms, backlog_max),
            "refused: connections_max reached",
            lambda _n: None,
            lambda reason: self.refused.update([reason]),
            lambda reason: self.dropped.update([reason]),
        )
        self.handled: list[int] = []
        self.answer_bytes = 100 * 1024
        self.cost_s = 0.0  # how long handling a frame holds the loop

    def dispatch(self, conn: FrameConnection, frame: Frame) -> None:
        self.handled.append(frame.request_id)
        if self.cost_s:
            time.sleep(self.cost_s)
        body = b"x" * self.answer_bytes if frame.code == RequestCode.READ else b""
        conn.respond(frame.code, frame.request_id, {}, [body] if body else ())

    def forget(self, conn: FrameConnection) -> None:
        self.connections.forget(conn)


def connect(host: Host) -> tuple[FrameConnection, FakeTransport]:
    conn = FrameConnection(host)
    transport = FakeTransport()
    transport.protocol = conn
    conn.connection_made(transport)  # type: ignore[arg-type]
    return conn, transport


def requests(code: int, first_id: int, n: int) -> bytes:
    return b"".join(encode_frame(Frame(code, i, {})) for i in range(first_id, first_id + n))


async def next_turns(n: int = 3) -> None:
    for _ in range(n):
        await asyncio.sleep(0)  # a loop turn: what call_soon scheduled runs


async def test_requests_wait_while_the_client_does_not_read_its_replies() -> None:
    host = Host()
    conn, transport = connect(host)
    assert transport.high == _HIGH_BYTES
    conn.data_received(requests(RequestCode.READ, 1, 300))
    # the first answer (100 KiB) passed the high-water mark: the 299 other requests wait, unread
    assert host.handled == [1]
    assert not transport.reading
    await next_turns()
    assert host.handled == [1]
    transport.drain()
    await next_turns()
    assert host.handled == [1, 2]  # one more answer, and the client stops reading again
    for _ in range(298):
        transport.drain()
        await next_turns(1)
    assert host.handled == list(range(1, 301))
    assert [f.request_id for f in transport.frames()] == list(range(1, 301))
    assert not transport.reading
    transport.drain()
    assert transport.reading  # nothing left waiting: reading resumes at once
    assert not transport.closed


def read_into(conn: FrameConnection, data: bytes) -> None:
    """What a transport does with a buffered protocol: read into its buffer, then say how much."""
    buffer = conn.get_buffer(len(data))
    assert len(buffer) >= len(data)
    buffer[: len(data)] = data
    conn.buffer_updated(len(data))


async def test_connections_read_into_one_buffer_and_each_keeps_its_own_bytes() -> None:
    host = Host()
    a, _a_t = connect(host)
    b, _b_t = connect(host)
    # a transport reads into the buffer the protocol gives (uvloop's SSL decrypts into it)
    assert isinstance(a, asyncio.BufferedProtocol)
    assert not isinstance(a, asyncio.Protocol)
    assert a.get_buffer(-1).obj is b.get_buffer(-1).obj  # one buffer for the server's connections
    frame_a, frame_b = requests(RequestCode.PING, 1, 1), requests(RequestCode.PING, 2, 1)
    # each connection's frame arrives in two reads, interleaved with the other's
    read_into(a, frame_a[:7])
    read_into(b, frame_b[:11])
    read_into(a, frame_a[7:])
    assert host.handled == [1]
    read_into(b, frame_b[11:])
    assert host.handled == [1, 2]


async def test_reading_goes_on_once_the_replies_are_read() -> None:
    host = Host()
    conn, transport = connect(host)
    conn.data_received(requests(RequestCode.PING, 1, 100))
    # small answers never reach the high-water mark; other connections get turns in between
    assert host.handled == list(range(1, _FRAMES_PER_TURN + 1))
    assert not transport.reading
    await next_turns(100 // _FRAMES_PER_TURN + 1)
    assert host.handled == list(range(1, 101))
    assert transport.reading


async def test_a_connection_gone_while_its_requests_wait_for_their_turn_has_none_handled() -> None:
    host = Host()
    conn, transport = connect(host)
    conn.data_received(requests(RequestCode.PING, 1, 100))
    transport.close()  # a write failed: the transport closes, connection_lost comes later
    await next_turns()
    assert host.handled == list(range(1, _FRAMES_PER_TURN + 1))  # nobody would read the rest's answers


async def test_answers_that_come_later_are_bounded_by_the_backlog_cap(caplog: pytest.LogCaptureFixture) -> None:
    host = Host(backlog_max=32 * MiB)
    conn, transport = connect(host)
    conn.data_received(requests(RequestCode.PING, 1, 1))
    # answers of requests taken before (parked pulls) land while the client reads nothing
    with caplog.at_level(logging.WARNING):
        for i in range(4):
            conn.respond(RequestCode.PULL, 100 + i, {}, [b"y" * (10 * MiB)])
    assert transport.aborted  # 40 MiB unread > 32 MiB: aborted, not closed after a flush
    assert conn.closed
    assert host.dropped == {"reply_backlog": 1}
    assert len(host.connections) == 0
    assert "over reply_backlog_bytes_max 33554432" in caplog.text
    conn.respond(RequestCode.PULL, 200, {}, [b"z"])  # a later answer is dropped quietly
    conn.data_received(requests(RequestCode.PING, 2, 1))
    assert host.handled == [1]


async def test_a_connection_that_sends_no_request_is_closed_after_the_timeout() -> None:
    host = Host(first_request_timeout_ms=100)
    _silent, silent_t = connect(host)
    partial, partial_t = connect(host)
    talker, talker_t = connect(host)
    partial.data_received(requests(RequestCode.PING, 1, 1)[:10])  # part of a frame is no request
    talker.data_received(requests(RequestCode.PING, 7, 1))
    assert len(host.connections) == 3
    await asyncio.sleep(0.3)
    assert silent_t.closed
    assert partial_t.closed
    assert not talker_t.closed
    assert host.dropped == {"no_request": 2}
    assert len(host.connections) == 1
    [bye] = silent_t.frames()
    assert bye.request_id == 0
    assert bye.status == Status.BAD_REQUEST
    assert "no request within first_request_timeout_ms 100 ms" in bye.header["error"]
    talker.data_received(requests(RequestCode.PING, 8, 1))  # quiet but open, long after
    assert host.handled == [7, 8]


async def test_a_connection_past_connections_max_is_told_why() -> None:
    host = Host(connections_max=2)
    _a, a_t = connect(host)
    _b, _b_t = connect(host)
    refused, refused_t = connect(host)
    assert host.refused == {"connections_max": 1}
    assert len(host.connections) == 2
    [frame] = refused_t.frames()
    assert (frame.response, frame.request_id, frame.status) == (True, 0, Status.BUSY)
    assert frame.header["error"] == "refused: connections_max reached"
    assert refused_t.eof
    assert not refused_t.closed
    refused.data_received(requests(RequestCode.PING, 1, 1))
    assert host.handled == []
    refused.connection_lost(None)  # the client closed its side
    assert len(host.connections) == 2
    assert not a_t.closed


def test_a_delay_server_counts_the_connections_it_refuses_and_drops(tmp_path: Path) -> None:
    class Shell(FrameServer):
        kind = "delay"
        title = "delay server"

        def health(self) -> dict[str, object]:
            return {"ok": True}

        async def checkpoint(self) -> None:
            pass

    metrics = DelayMetrics()
    config = DelayConfig(data_dir=tmp_path, connections_max=3)
    shell = Shell.__new__(Shell)
    shell.metrics = metrics  # as a role sets it before the shell's __init__
    FrameServer.__init__(shell, config, DEFAULT_LIMITS, metrics.connections.set, "test-checkpoint")
    try:
        text = shell.connections.refusal("connections_max", "127.0.0.9")
        assert "connections_max 3" in text
        assert "--connections-max, or connections_max in [delay]" in text
        text = shell.connections.refusal("connections_per_host_max", "127.0.0.9")
        assert "connections_per_host_max 1024 client connections open from 127.0.0.9" in text
        assert "--connections-per-host-max, or connections_per_host_max in [delay]" in text
        shell.connections.on_refused("connections_max")
        shell.connections.on_dropped("no_request")
        shell.connections.on_dropped("no_request")
        reg = metrics.registry
        assert reg.get_sample_value("qmq_delay_connections_refused_total", {"reason": "connections_max"}) == 1
        assert reg.get_sample_value("qmq_delay_connections_dropped_total", {"reason": "no_request"}) == 2
    finally:
        shell.checkpoint_executor.shutdown()


async def test_frames_that_take_the_loop_long_wait_for_the_next_turn_however_few() -> None:
    host = Host()
    host.cost_s = 0.003  # each request takes 3 ms of the loop (as a READ of a thousand messages)
    conn, transport = connect(host)
    conn.data_received(requests(RequestCode.PING, 1, 5))  # small answers: the client reads them
    # one frame past the turn's budget, and the others (a PING on another connection) run
    assert host.handled == [1]
    assert not transport.reading
    await next_turns(10)
    assert host.handled == [1, 2, 3, 4, 5]
    assert transport.reading
