"""One TCP connection to one broker address, and the pool that keeps one per address.

Many requests share a connection: each gets a request id and a future the response
resolves. A connection that is lost fails every request waiting on it with
``ConnectionLostError``; the next request opens a new one (after a bounded backoff when
connecting keeps failing). Each opening is an *incarnation* with its own random
``session`` id, which pulls carry so the broker can tell a consumer that reconnected.

The transport reads into a buffer of the connection's own (a buffered protocol): over TLS,
uvloop's SSL layer then decrypts in place, where a ``data_received`` protocol is handed each
record in a fresh 256 KiB ``bytes`` that the C allocator maps and unmaps again.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Iterable, Sequence
from ssl import SSLContext
from typing import TYPE_CHECKING, Any, cast

from qmq.common.errors import BrokerError, ConnectionLostError, QmqError
from qmq.common.limits import DEFAULT_LIMITS, KiB, Limits, MiB
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import AUTH_STATUSES, RemoteProtocolError, auth_error, error_for_status, status_name

if TYPE_CHECKING:
    from qmq.auth.handshake import ClientCredentials
from qmq.protocol.frame import REQUEST_ID_MAX, Frame, FrameDecoder, encode_frame_parts

log = logging.getLogger(__name__)

# Bytes the transport may buffer before it asks us to stop writing: room for several
# full send frames in flight, so flow control only bites when the broker stops reading.
_WRITE_HIGH_BYTES = 16 * MiB
_WRITE_LOW_BYTES = 4 * MiB
# What one read may bring: libuv reads 64 KiB from a socket at a time; over TLS, what does not
# fit is decrypted on the next loop turn
_READ_BUFFER_BYTES = 64 * KiB
_BACKOFF_MS_MIN = 50
_BACKOFF_MS_MAX = 2_000
# a server holds the handshake of an address with many failed ones for up to 1 s (qmq.auth.failures)
_HANDSHAKE_HELD_S_MAX = 1.0


def parse_address(address: str) -> tuple[str, int]:
    """``host:port`` (``[v6]:port`` too) as a (host, port) pair; ConnectionLostError if malformed."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ConnectionLostError(f"broker address {address!r} is not host:port; check the meta server's answer")
    return host.strip("[]"), int(port)


class _FrameProtocol(asyncio.BufferedProtocol):
    """One incarnation of a connection: its transport, its pending requests, its session."""

    def __init__(self, address: str, limits: Limits) -> None:
        self.address = address
        self.session = secrets.token_hex(8)
        self.transport: asyncio.Transport | None = None
        self.pending: dict[int, asyncio.Future[Frame]] = {}
        self.lost: BaseException | None = None
        self.server_said = ""  # why the broker closed the connection, when it said (request id 0)
        # requests written on this connection, and each pending one's place among them; a server
        # shutting down says how many it read (``peer_read``): the ones after were not carried out
        self.written = 0
        self.place: dict[int, int] = {}
        self.peer_read: int | None = None
        self.closed = asyncio.get_running_loop().create_future()
        self._decoder = FrameDecoder(limits)
        self._read_buffer = memoryview(bytearray(_READ_BUFFER_BYTES))
        self._paused = False
        self._drain_waiters: list[asyncio.Future[None]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports do not subclass asyncio.Transport but have its methods.
        transport = cast(asyncio.Transport, transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_WRITE_HIGH_BYTES, low=_WRITE_LOW_BYTES)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._read_buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._read_buffer[:nbytes])

    def data_received(self, data: bytes | memoryview) -> None:
        """What arrived: the decoder copies it at once (``data`` may be the read buffer)."""
        decoder = self._decoder
        try:
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                self._dispatch(frame)
        except RemoteProtocolError as exc:
            log.error("broker %s sent an invalid frame, closing the connection: %s", self.address, exc)
            self._fail_all(ConnectionLostError(f"broker {self.address} sent an invalid frame ({exc}); reconnecting"))
            if self.transport is not None:
                self.transport.abort()

    def _dispatch(self, frame: Frame) -> None:
        if not frame.response:
            log.warning("broker %s sent a request (code %d); clients serve none", self.address, frame.code)
            return
        fut = self.pending.pop(frame.request_id, None)
        self.place.pop(frame.request_id, None)
        if fut is None or fut.done():
            if frame.request_id == 0 and frame.status != Status.OK:
                self._said(frame)
            return  # otherwise the requester gave up (timeout or cancellation)
        if frame.status == Status.OK:
            fut.set_result(frame)
        elif frame.status in AUTH_STATUSES:
            fut.set_exception(auth_error(frame.header))
        else:
            header = frame.header
            error = error_for_status(frame.status, str(header.get("error", "")), header.get("outcome") == "unknown")
            retry_after_ms = header.get("retry_after_ms")
            if isinstance(error, BrokerError) and isinstance(retry_after_ms, int) and retry_after_ms > 0:
                error.retry_after_ms = retry_after_ms
            fut.set_exception(error)

    def _said(self, frame: Frame) -> None:
        """The broker's word on the connection (no request has id 0), before it closes it. At its
        shutdown that word counts the requests it read: none is written here after it."""
        header = frame.header
        self.server_said = f"{status_name(frame.status)}: {header.get('error', '')}"
        read = header.get("requests_read")
        if frame.status == Status.SHUTTING_DOWN and isinstance(read, int) and self.transport is not None:
            self.peer_read = read
            self.lost = ConnectionResetError("the broker is shutting down")  # write no more here
            self.transport.close()

    def pause_writing(self) -> None:
        self._paused = True

    def resume_writing(self) -> None:
        self._paused = False
        waiters, self._drain_waiters = self._drain_waiters, []
        for w in waiters:
            if not w.done():
                w.set_result(None)

    async def drain(self) -> None:
        while self._paused and self.lost is None:
            w = asyncio.get_running_loop().create_future()
            self._drain_waiters.append(w)
            await w
        if self.lost is not None:
            raise self._lost_error()

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = exc or self.lost or ConnectionResetError("closed")
        pending, self.pending = self.pending, {}
        place, self.place = self.place, {}
        read = self.peer_read
        for rid, fut in pending.items():
            if not fut.done():
                fut.set_exception(self._lost_error(unread=read is not None and place.get(rid, 0) > read))
        for w in self._drain_waiters:
            if not w.done():
                w.set_exception(self._lost_error())
        self._drain_waiters.clear()
        if not self.closed.done():
            self.closed.set_result(None)

    def _lost_error(self, *, unread: bool = False) -> ConnectionLostError:
        why = f"by the broker: {self.server_said}" if self.server_said else f"({self.lost})"
        if unread:
            return ConnectionLostError(
                f"connection to broker {self.address} closed {why}, before it read this request (not carried out)",
                outcome_unknown=False,
            )
        return ConnectionLostError(f"connection to broker {self.address} closed {why}; reconnecting on next use")

    def _fail_all(self, error: QmqError) -> None:
        pending, self.pending = self.pending, {}
        self.place = {}
        for fut in pending.values():
            if not fut.done():
                fut.set_exception(error)


class Connection:
    """Requests to one broker address over one connection, reopened on the next use after a loss."""

    def __init__(
        self,
        address: str,
        *,
        connect_timeout_ms: int,
        limits: Limits = DEFAULT_LIMITS,
        credentials: ClientCredentials | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.address = address
        self._credentials = credentials
        self._ssl = ssl
        self._host, self._port = parse_address(address)
        self._connect_timeout_s = connect_timeout_ms / 1000
        self._limits = limits
        self._proto: _FrameProtocol | None = None
        self._connecting: asyncio.Task[_FrameProtocol] | None = None
        self._warming: asyncio.Task[_FrameProtocol] | None = None  # the connect of warm(), until a request sees it
        self._next_id = 1
        self._failures = 0
        self._retry_at = 0.0
        self._last_error = ""
        self._closed = False
        self._queued = 0  # requests waiting to be written, in turn (see start_request)
        self._turns = asyncio.Lock()
        self.incarnations = 0

    @property
    def connected(self) -> bool:
        p = self._proto
        return p is not None and p.lost is None

    async def _protocol(self) -> _FrameProtocol:
        p = self._proto
        if p is not None and p.lost is None:
            return p
        if self._closed:
            raise ConnectionLostError(f"connection to broker {self.address} is closed")
        task = self._connecting
        # a connect warm() began and that failed: its error is the answer, once (a refused secret
        # is then told, and counted by the server, once, not again by a second handshake)
        warmed, self._warming = self._warming, None
        failed_warm = task is warmed and task is not None and task.done() and not task.cancelled() and task.exception()
        if task is None or (task.done() and not failed_warm):
            task = self._connecting = asyncio.ensure_future(self._connect())
            # Retrieved here too, in case every caller stopped waiting before it ended.
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        try:
            # Shielded: one caller giving up must not cancel the connect others wait for.
            return await asyncio.shield(task)
        finally:
            if task.done() and self._connecting is task:
                self._connecting = None

    async def _connect(self) -> _FrameProtocol:
        loop = asyncio.get_running_loop()
        delay = self._retry_at - loop.time()
        if delay > 0:
            # Fail fast while backing off: callers retry elsewhere or later on their own terms.
            raise ConnectionLostError(
                f"cannot connect to broker {self.address} ({self._last_error}); next attempt in {delay * 1000:.0f} ms"
            )
        try:
            async with asyncio.timeout(self._connect_timeout_s):
                _, proto = await loop.create_connection(
                    lambda: _FrameProtocol(self.address, self._limits),
                    self._host,
                    self._port,
                    ssl=self._ssl,
                    server_hostname=self._host if self._ssl is not None else None,
                )
        except (OSError, TimeoutError) as exc:
            self._failures += 1
            backoff_ms = min(_BACKOFF_MS_MAX, _BACKOFF_MS_MIN * 2 ** min(self._failures - 1, 16))
            self._retry_at = loop.time() + backoff_ms / 1000
            reason = "timed out" if isinstance(exc, TimeoutError) else str(exc)
            self._last_error = reason
            raise ConnectionLostError(
                f"cannot connect to broker {self.address}: {reason}; is the broker running and reachable?"
            ) from None
        self._failures = 0
        self._retry_at = 0.0
        self.incarnations += 1
        if self._credentials is not None:
            try:
                await self._authenticate(proto, self._credentials)
            except BaseException:
                proto.transport.close()  # type: ignore[union-attr]
                raise
        if self._closed:
            proto.transport.close()  # type: ignore[union-attr]
            raise ConnectionLostError(f"connection to broker {self.address} is closed")
        self._proto = proto
        return proto

    async def _authenticate(self, p: _FrameProtocol, credentials: ClientCredentials) -> None:
        """The handshake of a new connection (qmq.auth.handshake); AuthError when refused."""
        from qmq.auth.handshake import HandshakeError

        hello, client_nonce = credentials.hello()
        timeout_s = self._connect_timeout_s + _HANDSHAKE_HELD_S_MAX
        try:
            async with asyncio.timeout(timeout_s):
                challenge = await self._write_request(p, RequestCode.AUTH_HELLO, hello, (), False)
            # scrypt takes tens of milliseconds: off the loop (and once per salt, then cached)
            loop = asyncio.get_running_loop()
            proof = await loop.run_in_executor(None, credentials.proof, challenge.header, client_nonce)
            async with asyncio.timeout(timeout_s):
                await self._write_request(p, RequestCode.AUTH_PROOF, proof, (), False)
        except TimeoutError:
            raise ConnectionLostError(
                f"broker {self.address} did not finish the handshake within {timeout_s:.1f} s", outcome_unknown=False
            ) from None
        except HandshakeError as exc:
            raise ConnectionLostError(
                f"broker {self.address} sent a bad challenge: {exc}", outcome_unknown=False
            ) from None

    def warm(self) -> None:
        """Connect (and authenticate) in the background now, so the first request finds the
        connection ready; a failure here is met again, and reported, by the next request."""
        if self.connected or self._closed or (self._connecting is not None and not self._connecting.done()):
            return
        task = self._connecting = self._warming = asyncio.ensure_future(self._connect())
        task.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def start_request(
        self,
        code: int,
        header: dict[str, Any],
        body: Sequence[bytes] = (),
        *,
        with_session: bool = False,
    ) -> asyncio.Future[Frame]:
        """Write a request; return the future its response resolves (kept pending until then).

        With ``with_session``, ``header["session"]`` is set to the session of the
        incarnation the request is written on.
        """
        if self.writable():
            return self._write_request(self._proto, code, header, body, with_session)  # type: ignore[arg-type]
        # Requests that must wait (for a connect, or for the socket to drain) are written in the
        # order they were made, and none made meanwhile overtakes them: woken waiters run a loop
        # turn or two after the connection is ready, when a newcomer could already have written.
        self._queued += 1
        try:
            async with self._turns:
                p = await self._protocol()
                if p._paused:
                    await p.drain()
                if p.lost is not None or p.transport is None:
                    raise p._lost_error()
                return self._write_request(p, code, header, body, with_session)
        finally:
            self._queued -= 1

    def writable(self) -> bool:
        """Whether a request can be written now: connected, the socket not full, and no earlier
        request waiting to be written."""
        p = self._proto
        return p is not None and p.lost is None and p.transport is not None and not p._paused and not self._queued

    def write_request(self, code: int, header: dict[str, Any], body: Sequence[bytes] = ()) -> asyncio.Future[Frame]:
        """``start_request`` for a connection that is ``writable()``: writes at once, no await."""
        p = self._proto
        if p is None or not self.writable():
            raise ConnectionLostError(f"connection to broker {self.address} is not writable now")
        return self._write_request(p, code, header, body, False)

    def _write_request(
        self, p: _FrameProtocol, code: int, header: dict[str, Any], body: Sequence[bytes], with_session: bool
    ) -> asyncio.Future[Frame]:
        assert p.transport is not None
        rid = self._next_id
        pending = p.pending
        while rid in pending:
            rid = rid + 1 if rid < REQUEST_ID_MAX else 1
        self._next_id = rid + 1 if rid < REQUEST_ID_MAX else 1
        if with_session:
            header["session"] = p.session
        body_len = sum(map(len, body)) if body else 0
        head = encode_frame_parts(code, rid, header, body_len, limits=self._limits)
        fut: asyncio.Future[Frame] = asyncio.get_running_loop().create_future()
        pending[rid] = fut
        p.written += 1
        p.place[rid] = p.written
        if body:
            if self._ssl is not None:
                # over TLS each buffer written becomes a record of its own: one record for the
                # frame, not one per message (a 1 KiB record costs the broker a read each)
                p.transport.write(b"".join((head, *body)))
            else:
                p.transport.writelines([head, *body])
        else:
            p.transport.write(head)
        fut.add_done_callback(lambda f: (pending.pop(rid, None), p.place.pop(rid, None)) if f.cancelled() else None)
        return fut

    async def request(
        self,
        code: int,
        header: dict[str, Any],
        body: Sequence[bytes] = (),
        *,
        with_session: bool = False,
    ) -> Frame:
        """Send a request and wait for its response; a non-OK status raises its error.

        A ConnectionLostError says whether the request may have been carried out: not when it
        could not be written (``outcome_unknown`` False), maybe when the connection went after."""
        try:
            fut = await self.start_request(code, header, body, with_session=with_session)
        except ConnectionLostError as exc:
            exc.outcome_unknown = False  # never written
            raise
        return await fut

    def abort(self) -> None:
        """Drop the current incarnation (its requests fail); the next request reconnects."""
        p = self._proto
        if p is not None and p.transport is not None and p.lost is None:
            # Forget it now: connection_lost comes a loop turn later, and a request made
            # meanwhile must go to a new incarnation, not the one being torn down.
            self._proto = None
            p.transport.abort()

    async def close(self) -> None:
        self._closed = True
        if self._connecting is not None:
            self._connecting.cancel()
        p = self._proto
        if p is not None and p.transport is not None and p.lost is None:
            p.transport.close()
            try:
                async with asyncio.timeout(1.0):
                    await asyncio.shield(p.closed)
            except TimeoutError:
                p.transport.abort()


class ConnectionPool:
    """One ``Connection`` per broker address, made on first use."""

    def __init__(
        self,
        *,
        connect_timeout_ms: int,
        limits: Limits = DEFAULT_LIMITS,
        credentials: ClientCredentials | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self._connect_timeout_ms = connect_timeout_ms
        self._credentials = credentials
        self._ssl = ssl
        self._limits = limits
        self._connections: dict[str, Connection] = {}
        self._closed = False

    def get(self, address: str) -> Connection:
        conn = self._connections.get(address)
        if conn is None:
            if self._closed:
                raise ConnectionLostError(f"the client is closed; cannot reach broker {address}")
            conn = Connection(
                address,
                connect_timeout_ms=self._connect_timeout_ms,
                limits=self._limits,
                credentials=self._credentials,
                ssl=self._ssl,
            )
            self._connections[address] = conn
        return conn

    def authenticate_early(self, addresses: Iterable[str]) -> None:
        """With credentials, connect to the first of ``addresses`` in the background: the
        client key the handshake needs (scrypt, some tens of milliseconds) is derived once per
        app and kept, so the first send or pull then waits for neither it nor the connection."""
        if self._credentials is None:
            return
        for address in addresses:
            self.get(address).warm()
            return

    async def close(self) -> None:
        self._closed = True
        conns, self._connections = list(self._connections.values()), {}
        await asyncio.gather(*(c.close() for c in conns), return_exceptions=True)
