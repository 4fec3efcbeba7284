"""One client connection of a server: an ``asyncio.BufferedProtocol`` feeding a sans-IO
``FrameDecoder``, and the set of them with what each may cost the server.

The transport reads into one buffer that every connection of the server shares (the decoder
copies what arrived before the read returns, so no two reads overlap in it). Over TLS this is
what keeps a read cheap: a ``data_received`` protocol makes the SSL layer read each record into
a fresh 256 KiB ``bytes``, which the C allocator maps, faults in and unmaps again (three
system calls and a few page faults per 16 KiB record); a buffered one has it decrypt in place.

Requests are handled as they are decoded, on the loop, without a task per request. After a
frame whose code is in the host's ``yield_after`` set (sends), after ``_FRAMES_PER_TURN``
frames of any kind, or once the frames handled took ``_TURN_BUDGET_S`` of the loop, the rest of
what arrived waits for the next loop turn (reading paused), so timers, heartbeats and other
connections run between frames however many requests one client pipelines: a hundred clients
pipelining READs of a thousand messages each hold a turn about a hundred budgets, not 1,600
READs (a PING waited over a second behind them). A frame that cannot be decoded costs only its
own connection: the peer gets an error frame, then the connection closes. Once the connection
is closing (the peer went away: a write failed), the requests it left decoded are dropped, not
handled.

What one client can hold of the server is bounded:
- replies it does not read: once the transport's write buffer passes its high-water mark
  (``_WRITE_HIGH_BYTES``), the connection stops reading *and* stops handling the requests it
  already decoded, until the buffer drains below the low-water mark. Answers to requests
  handled before (a group commit's, a parked pull's) are still written when they come, so
  the buffer has a hard cap, ``reply_backlog_bytes_max``: past it the connection is aborted,
  its unread replies dropped, and the reason logged;
- a connection that sends no complete request within ``first_request_timeout_ms`` of opening
  is closed (an SDK sends its first request as soon as it connects; a connection that has
  sent one stays open however long it is quiet, since clients idle between sends and polls);
- past ``connections_max``, or past ``connections_per_host_max`` from the same host (IP
  address), a new connection gets an error frame saying so, and the setting to raise, before
  it is closed: one host's idle or hostile connections cannot take every slot.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, cast

from prometheus_client import CollectorRegistry, Counter

from qmq.auth.permissions import Grants
from qmq.common.limits import KiB, Limits
from qmq.protocol.codes import Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame_parts

log = logging.getLogger(__name__)

# Replies buffered past this stop the handling of requests until they drain below the low mark:
# asyncio's and uvloop's defaults, set here so the bound does not hang on the loop's choice.
_WRITE_HIGH_BYTES = 64 * KiB
_WRITE_LOW_BYTES = 16 * KiB
# The read buffer the server's connections share: as much as one read may bring (uvloop reads
# 64 KiB from a socket; a TLS record is at most 16 KiB, and several are decrypted per read)
_READ_BUFFER_BYTES = 256 * KiB
# Frames handled for one connection in one loop turn before the others get theirs: a client that
# pipelines thousands of requests (each READ may read a thousand messages) waits its turn.
_FRAMES_PER_TURN = 16
# The loop time one connection's frames may take in one turn, however few: past it, the next frame
# waits for the next turn (one frame is always handled, whatever it costs).
_TURN_BUDGET_S = 0.001
# A refused connection is closed once the client has closed its side, or after this long: a close
# with the client's request unread would reset the connection, and the reset can overtake the
# error frame that says why.
_REFUSAL_LINGER_S = 1.0


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
    connections: Connections

    def dispatch(self, conn: FrameConnection, frame: Frame) -> None: ...

    def forget(self, conn: FrameConnection) -> None: ...


class FrameConnection(asyncio.BufferedProtocol):
    def __init__(self, host: ConnectionHost) -> None:
        self.host = host
        self.decoder = FrameDecoder(host.limits)
        self._read_buffer = host.connections.read_buffer
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.peer_host = "?"  # the IP address, what connections_per_host_max counts by
        self.closed = False
        self._flow_paused = False  # the client reads our answers too slowly
        self._turn_paused = False  # frames left for the next loop turn
        # until the first request: the deadline for it; on a refused connection: the linger's end
        self._timer: asyncio.TimerHandle | None = None
        # on a server with an auth file (qmq.serving.auth_gate): the app once authenticated, what
        # it may do (kept current across reloads of the file), and the handshake under way
        self.app_code: str | None = None
        self.grants: Grants | None = None
        self.handshake: object | None = None
        self._tls = False  # the connection speaks TLS (set when it is made)
        # the common name of the client's certificate, verified against --tls-ca (None without one)
        self.cert_subject: str | None = None
        # requests taken from the decoder and handled: what the goodbye at shutdown tells the
        # client, so it knows the ones it wrote after were never read (not carried out)
        self.requests_read = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's TCPTransport does not subclass asyncio.Transport but has its methods
        self.transport = tr = cast(asyncio.Transport, transport)
        peer = tr.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        self.peer_host = str(peer[0]) if isinstance(peer, tuple) else str(peer)
        tr.set_write_buffer_limits(high=_WRITE_HIGH_BYTES, low=_WRITE_LOW_BYTES)
        self._tls = tr.get_extra_info("sslcontext") is not None
        if self._tls:
            self.cert_subject = _common_name(tr.get_extra_info("peercert"))
        connections = self.host.connections
        refusal = connections.admit(self)
        loop = asyncio.get_running_loop()
        if refusal is not None:
            self._refuse(refusal, loop)
        else:
            self._timer = loop.call_later(connections.limits.first_request_timeout_ms / 1000, self._no_request)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._read_buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """What arrived: the decoder copies it at once (``data`` may be the shared read buffer)."""
        if self._gone():
            return
        try:
            self.decoder.receive_data(data)
        except RemoteProtocolError as exc:
            self._protocol_error(exc)
            return
        if self._timer is not None:
            self._first_data()
        elif not (self._turn_paused or self._flow_paused):
            self._handle_frames()

    def _first_data(self) -> None:
        """Handle what arrived before the first request, and end its deadline once one came."""
        decoder = self.decoder
        before = decoder.buffered_bytes
        if not (self._turn_paused or self._flow_paused):
            self._handle_frames()
        # the decoder gives up bytes only with a complete frame
        if decoder.buffered_bytes < before:
            self._stop_timer()

    def _gone(self) -> bool:
        """Closed, or closing: a write to the peer failed (it went away) and connection_lost is
        on its way. What it left decoded is not worth handling: nobody reads the answers."""
        return self.closed or self.transport is None or self.transport.is_closing()

    def _handle_frames(self) -> None:
        decoder = self.decoder
        host = self.host
        dispatch = host.dispatch
        yield_after = host.yield_after
        handled = 0
        began = time.perf_counter()
        try:
            # a handler's answer may fill the write buffer (pause_writing): the frames after it
            # wait in the decoder until resume_writing
            while not self._gone() and not self._flow_paused and (frame := decoder.next_frame()) is not None:
                if frame.response:
                    raise RemoteProtocolError("a client sent a response frame; only requests are accepted")
                dispatch(self, frame)
                self.requests_read += 1
                handled += 1
                if (
                    frame.code in yield_after
                    or handled >= _FRAMES_PER_TURN
                    or time.perf_counter() - began >= _TURN_BUDGET_S
                ) and decoder.buffered_bytes:
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
        if self.transport is None or self._gone():
            return
        if self._flow_paused or self._turn_paused:
            self.transport.pause_reading()
        else:
            self.transport.resume_reading()

    def respond(
        self,
        code: int,
        request_id: int,
        header: dict[str, Any] | None,
        chunks: Sequence[bytes] = (),
        status: int = Status.OK,
    ) -> None:
        if self.transport is None or self._gone():
            return
        body_len = sum(len(c) for c in chunks) if chunks else 0
        head = encode_frame_parts(code, request_id, header, body_len, status=status, response=True)
        if chunks:
            if self._tls:
                # over TLS each buffer written is a record of its own: one per answer instead
                self.transport.write(b"".join((head, *chunks)))
            else:
                self.transport.writelines([head, *chunks])
        else:
            self.transport.write(head)
        if self._flow_paused:
            backlog_bytes = self.transport.get_write_buffer_size()
            if backlog_bytes > self.host.connections.limits.reply_backlog_bytes_max:
                self._too_much_unread(backlog_bytes)

    def pause_writing(self) -> None:
        self._flow_paused = True
        self._set_reading()

    def resume_writing(self) -> None:
        self._flow_paused = False
        if self.decoder.buffered_bytes and not self._turn_paused and not self._gone():
            self._next_turn()  # the requests that waited for the client to read, from the next turn
        else:
            self._set_reading()

    # -- ends ------------------------------------------------------------------------------

    def _protocol_error(self, exc: RemoteProtocolError) -> None:
        self._drop("protocol_error", f"protocol error: {exc}", Status.BAD_REQUEST)

    def _no_request(self) -> None:
        self._timer = None
        timeout_ms = self.host.connections.limits.first_request_timeout_ms
        self._drop("no_request", f"no request within first_request_timeout_ms {timeout_ms} ms", Status.BAD_REQUEST)

    def _too_much_unread(self, backlog_bytes: int) -> None:
        cap = self.host.connections.limits.reply_backlog_bytes_max
        log.warning(
            "aborting connection from %s: %d bytes of replies it has not read, over reply_backlog_bytes_max %d "
            "(a client must read its replies)",
            self.peer,
            backlog_bytes,
            cap,
        )
        self.host.connections.on_dropped("reply_backlog")
        self.closed = True
        self._stop_timer()
        if self.transport is not None:
            self.transport.abort()  # close() would keep the backlog until the client read it
        self.host.forget(self)

    def _drop(self, reason: str, text: str, status: Status) -> None:
        """Close for ``reason`` (a metric's label), telling the client ``text`` in an error frame."""
        log.warning("closing connection from %s: %s", self.peer, text)
        self.host.connections.on_dropped(reason)
        self.respond(0, 0, {"error": f"{text}; closing the connection"}, status=status)
        self.close()

    def _refuse(self, text: str, loop: asyncio.AbstractEventLoop) -> None:
        """Say why in an error frame, then close once the client has closed (or the linger ends)."""
        self.closed = True
        transport = self.transport
        assert transport is not None
        transport.write(encode_frame_parts(0, 0, {"error": text}, 0, status=Status.BUSY, response=True))
        if transport.can_write_eof():
            transport.write_eof()
        self._timer = loop.call_later(_REFUSAL_LINGER_S, transport.close)

    def say_goodbye(self, text: str) -> None:
        """Close at shutdown, first telling the client ``text`` and how many of its requests
        this server read (``requests_read``, in an error frame of request id 0): those it wrote
        after were not carried out, so it may send them elsewhere without risking a duplicate."""
        self.respond(0, 0, {"error": text, "requests_read": self.requests_read}, status=Status.SHUTTING_DOWN)
        self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self._stop_timer()
        self.host.forget(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._stop_timer()
        self.host.forget(self)

    def _stop_timer(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None


def _common_name(peercert: object) -> str | None:
    """The subject's commonName of a verified peer certificate (``SSLSocket.getpeercert()``), or None."""
    if not isinstance(peercert, dict):
        return None
    for rdn in peercert.get("subject", ()):
        for key, value in rdn:
            if key == "commonName" and isinstance(value, str):
                return value
    return None


@dataclass(frozen=True, slots=True)
class ConnectionLimits:
    """What the connections of one server may cost it (fields of the role's config)."""

    connections_max: int
    first_request_timeout_ms: int
    reply_backlog_bytes_max: int
    connections_per_host_max: int = 1_000_000


class Connections:
    """The open connections of a server, at most ``limits.connections_max`` in all and
    ``limits.connections_per_host_max`` from one host (a new one past either is refused with
    the text ``refusal`` gives for that setting, which its client is sent), and the counts of
    those it refused and of those it closed on its own, by reason."""

    def __init__(
        self,
        limits: ConnectionLimits,
        refusal: str | Callable[[str, str], str],
        on_count: Callable[[int], None],
        on_refused: Callable[[str], None],
        on_dropped: Callable[[str], None],
    ) -> None:
        self.limits = limits
        # (setting, host) -> the text a refused client is sent
        self.refusal: Callable[[str, str], str] = refusal if callable(refusal) else (lambda _s, _h: refusal)
        self.on_count = on_count
        self.on_refused = on_refused
        self.on_dropped = on_dropped
        self._open: set[FrameConnection] = set()
        self._per_host: dict[str, int] = {}  # open connections by peer host; no entry at 0
        # what every connection's transport reads into (FrameConnection.get_buffer); all are
        # on one loop, and each read is consumed before the next begins
        self.read_buffer = memoryview(bytearray(_READ_BUFFER_BYTES))

    def __len__(self) -> int:
        return len(self._open)

    def admit(self, conn: FrameConnection) -> str | None:
        """Take a new connection: None, or the text that refuses it (past connections_max, or
        past connections_per_host_max from its host)."""
        limits = self.limits
        host = conn.peer_host
        if len(self._open) >= limits.connections_max:
            setting, value = "connections_max", limits.connections_max
        elif self._per_host.get(host, 0) >= limits.connections_per_host_max:
            setting, value = "connections_per_host_max", limits.connections_per_host_max
        else:
            self._open.add(conn)
            self._per_host[host] = self._per_host.get(host, 0) + 1
            self.on_count(len(self._open))
            return None
        log.warning("refusing connection from %s: %s %d reached", conn.peer, setting, value)
        self.on_refused(setting)
        return self.refusal(setting, host)

    def forget(self, conn: FrameConnection) -> None:
        if conn in self._open:
            self._open.discard(conn)
            left = self._per_host.get(conn.peer_host, 1) - 1
            if left > 0:
                self._per_host[conn.peer_host] = left
            else:
                self._per_host.pop(conn.peer_host, None)
            self.on_count(len(self._open))

    def close_all(self, goodbye: str) -> None:
        """Close every connection, each told ``goodbye`` and how many of its requests were read."""
        for conn in list(self._open):
            conn.say_goodbye(goodbye)


def connection_counters(prefix: str, registry: CollectorRegistry) -> tuple[Counter, Counter]:
    """A role's counters of the connections it refused and of those it closed on its own, by
    reason (``Connections``' ``on_refused`` and ``on_dropped``), named after ``prefix``."""
    refused = Counter(
        f"{prefix}_connections_refused", "client connections refused, by reason", ["reason"], registry=registry
    )
    dropped = Counter(
        f"{prefix}_connections_dropped",
        "client connections the server closed on its own, by reason: no_request (none within "
        "first_request_timeout_ms), reply_backlog (replies unread past reply_backlog_bytes_max), protocol_error",
        ["reason"],
        registry=registry,
    )
    return refused, dropped
