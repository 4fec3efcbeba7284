"""One client connection of a server: an ``asyncio.Protocol`` feeding a sans-IO ``FrameDecoder``.

Requests are handled as they are decoded, on the loop, without a task per request. After a
frame whose code is in the host's ``yield_after`` set (sends), the rest of what arrived waits
for the next loop turn (reading paused), so timers and other connections run between
frames. A handler that answers a request on a later loop turn, and must handle nothing
after it before then, ``hold``s the connection until it calls ``release``. A frame that
cannot be decoded costs only its own connection: the peer gets an error frame, then the
connection closes. When the peer reads answers slower than they are written, its requests
stop being read until it catches up.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from qmq.common.limits import Limits
from qmq.protocol.codes import Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame_parts

log = logging.getLogger(__name__)


class Responder(Protocol):
    """What a request handler answers through."""

    def respond(
        self,
        code: int,
        request_id: int,
        header: dict[str, Any] | None,
        chunks: Sequence[bytes] = (),
        status: int = Status.OK,
    ) -> None: ...


class ConnectionHost(Protocol):
    """The server behind a connection."""

    limits: Limits
    yield_after: frozenset[int]

    def admit(self, conn: FrameConnection) -> bool:
        """Take a new connection (False: refuse it, e.g. past connections_max)."""
        ...

    def dispatch(self, conn: FrameConnection, frame: Frame) -> None: ...

    def forget(self, conn: FrameConnection) -> None: ...


class FrameConnection(asyncio.Protocol):
    def __init__(self, host: ConnectionHost) -> None:
        self.host = host
        self.decoder = FrameDecoder(host.limits)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        self._flow_paused = False  # the client reads our answers too slowly
        self._turn_paused = False  # frames left for the next loop turn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        if not self.host.admit(self):
            transport.close()
            self.closed = True

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        try:
            self.decoder.receive_data(data)
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        if not self._turn_paused:
            self._handle_frames()

    def _handle_frames(self) -> None:
        decoder = self.decoder
        host = self.host
        dispatch = host.dispatch
        yield_after = host.yield_after
        try:
            while not self.closed and (frame := decoder.next_frame()) is not None:
                if frame.response:
                    raise RemoteProtocolError("a client sent a response frame; only requests are accepted")
                dispatch(self, frame)
                if frame.code in yield_after and decoder.buffered_bytes:
                    self._next_turn()
                    return
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        if self._turn_paused:
            self._turn_paused = False
            self._set_reading()

    def _next_turn(self) -> None:
        if not self._turn_paused:
            self._turn_paused = True
            self._set_reading()
        asyncio.get_running_loop().call_soon(self._handle_frames)

    def _set_reading(self) -> None:
        if self.transport is None or self.closed:
            return
        if self._flow_paused or self._turn_paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        log.warning("closing connection from %s: %s", self.peer, exc)
        self.respond(0, 0, {"error": f"protocol error: {exc}; closing the connection"}, status=Status.BAD_REQUEST)
        self.close()

    def respond(
        self,
        code: int,
        request_id: int,
        header: dict[str, Any] | None,
        chunks: Sequence[bytes] = (),
        status: int = Status.OK,
    ) -> None:
        if self.closed or self.transport is None:
            return
        body_len = sum(len(c) for c in chunks) if chunks else 0
        head = encode_frame_parts(code, request_id, header, body_len, status=status, response=True)
        if chunks:
            self.transport.writelines([head, *chunks])
        else:
            self.transport.write(head)

    def pause_writing(self) -> None:
        self._flow_paused = True
        self._set_reading()

    def resume_writing(self) -> None:
        self._flow_paused = False
        self._set_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.host.forget(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.host.forget(self)


class Connections:
    """The open connections of a server, at most ``limit`` (a new one past it is refused)."""

    def __init__(self, limit: int, on_count: Callable[[int], None]) -> None:
        self.limit = limit
        self.on_count = on_count
        self._open: set[FrameConnection] = set()

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: FrameConnection) -> bool:
        if len(self._open) >= self.limit:
            log.warning("refusing connection from %s: connections_max %d reached", conn.peer, self.limit)
            return False
        self._open.add(conn)
        self.on_count(len(self._open))
        return True

    def forget(self, conn: FrameConnection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            self.on_count(len(self._open))

    def close_all(self) -> None:
        for conn in list(self._open):
            conn.close()
