"""The broker process: listens for clients, serves metrics, registers with the meta server,
checkpoints and applies retention on timers, and shuts down in order.

Each connection is an ``asyncio.Protocol`` feeding a sans-IO ``FrameDecoder``; requests are
handled as they are decoded, on the loop, without a task per request. A frame that cannot be
decoded costs only its own connection.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import resource
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

import uvloop
from aiohttp import web

from qmq.broker.flusher import Flusher
from qmq.broker.handlers import Handlers
from qmq.broker.metrics import CONTENT_TYPE, BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.broker.registration import Registration, broker_payload
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import BrokerConfig
from qmq.common.errors import ConfigError
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.common.naming import RETRY_PREFIX
from qmq.protocol.codes import Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import FrameDecoder, encode_frame_parts
from qmq.store.broker_store import BrokerStore, StoreError
from qmq.store.redelivery import expire_silent_consumers

log = logging.getLogger(__name__)

EXIT_STARTUP_FAILED = 3


class StartupError(Exception):
    """The broker cannot start; the text says why and what to do."""


class BrokerConnection(asyncio.Protocol):
    def __init__(self, broker: BrokerServer) -> None:
        self.broker = broker
        self.decoder = FrameDecoder(broker.limits)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        broker = self.broker
        if len(broker.connections) >= broker.config.connections_max:
            log.warning(
                "refusing connection from %s: connections_max %d reached",
                self.peer,
                broker.config.connections_max,
            )
            transport.close()
            self.closed = True
            return
        broker.connections.add(self)
        broker.metrics.connections.set(len(broker.connections))

    def data_received(self, data: bytes) -> None:
        if self.closed:
            return
        decoder = self.decoder
        dispatch = self.broker.handlers.dispatch
        try:
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                if frame.response:
                    raise RemoteProtocolError("a client sent a response frame; only requests are accepted")
                dispatch(self, frame)
        except RemoteProtocolError as exc:
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
        # The client reads slower than we answer: stop reading its requests until it catches up.
        if self.transport is not None:
            self.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.transport is not None and not self.closed:
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            if self.transport is not None:
                self.transport.close()
        self.broker.forget(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.broker.forget(self)


class BrokerServer:
    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.store = BrokerStore(config, clock, limits)
        self.metrics = BrokerMetrics(self.store)
        self.parked = ParkedPulls(self.store, self.metrics.waiting_pulls.set)
        self.flusher = Flusher(self.store, self.parked.notify, self.metrics.flush_seconds.observe, self._disk_failed)
        self.handlers = Handlers(self)
        self.connections: set[BrokerConnection] = set()
        self.stopping = False
        self.port = 0
        self.http_port = 0
        self._server: asyncio.Server | None = None
        self._http: web.AppRunner | None = None
        self._registration: Registration | None = None
        self._timers: list[asyncio.Task[None]] = []
        self._checkpointing: asyncio.Lock | None = None

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    async def start(self) -> None:
        """Recover the store, listen, serve metrics, and (with a meta server) register."""
        _raise_fd_limit()
        report = self.store.open()
        log.info("store recovered: %s", report)
        self._checkpointing = asyncio.Lock()
        loop = asyncio.get_running_loop()
        cfg = self.config
        try:
            self._server = await loop.create_server(lambda: BrokerConnection(self), cfg.host, cfg.port, backlog=1024)
        except OSError as exc:
            raise StartupError(_listen_error("broker", cfg.host, cfg.port, exc, "--port")) from None
        self.port = self._server.sockets[0].getsockname()[1]
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._http = web.AppRunner(app, access_log=None)
        await self._http.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in cfg.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((cfg.host, cfg.http_port))
        except OSError as exc:
            sock.close()
            raise StartupError(_listen_error("metrics", cfg.host, cfg.http_port, exc, "--http-port")) from None
        self.http_port = sock.getsockname()[1]
        await web.SockSite(self._http, sock).start()
        if cfg.flush == "periodic":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self._timers.append(loop.create_task(self._every(cfg.checkpoint_interval_ms, self.checkpoint)))
        self._timers.append(loop.create_task(self._every(cfg.retention_check_interval_ms, self._retention)))
        silent_check_ms = max(10, min(cfg.consumer_offline_ms // 4, 5_000))
        self._timers.append(loop.create_task(self._every(silent_check_ms, self._expire_silent)))
        if cfg.meta_server:
            self._registration = Registration(
                cfg.meta_server,
                broker_payload(cfg.group, self.address, f"{cfg.host}:{self.http_port}"),
                cfg.heartbeat_interval_ms,
            )
            self._registration.start()

    async def wait_registered(self) -> None:
        if self._registration is not None:
            await self._registration.registered.wait()

    async def _every(self, interval_ms: int, job: Any) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000)
            try:
                await job()
            except Exception:  # a failed checkpoint or retention run is retried next time
                log.exception("periodic %s failed", getattr(job, "__name__", job))

    async def checkpoint(self) -> None:
        assert self._checkpointing is not None
        async with self._checkpointing:
            store = self.store
            state = store.checkpoint_state()
            ticket = store.begin_flush(consume_logs=True)
            await asyncio.get_running_loop().run_in_executor(
                self.flusher.executor, store.write_checkpoint, ticket, state
            )
            store.after_checkpoint(state)

    async def _retention(self) -> None:
        self.store.run_retention()

    async def _expire_silent(self) -> None:
        if expire_silent_consumers(self.store, self.clock.now_ms(), self.config.consumer_offline_ms):
            self.after_internal_append({s for s in self.store.subjects if s.startswith(RETRY_PREFIX)})

    def after_internal_append(self, subjects: set[str]) -> None:
        """The broker stored messages itself (retries): make them visible and wake their long polls."""
        if self.store.sync_policy:
            self.flusher.after_write(self.store.mlog.end, lambda _error: None)
        else:
            self.parked.notify(subjects)

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, _request: web.Request) -> web.Response:
        ok = not self.stopping and self.flusher.failed is None
        return web.json_response({"ok": ok, "group": self.config.group}, status=200 if ok else 503)

    def forget(self, conn: BrokerConnection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connections.set(len(self.connections))
        self.parked.drop_owner(conn)

    def _disk_failed(self, exc: BaseException) -> None:
        log.critical("the broker's disk failed (%s); it no longer takes sends", exc)

    async def stop(self) -> None:
        """Stop accepting, answer parked pulls, finish in-flight writes, flush, checkpoint, close."""
        if self.stopping:
            return
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._registration is not None:
            await self._registration.stop()
        self.parked.answer_all_empty()
        if not await self.flusher.drain(self.config.shutdown_grace_ms / 1000):
            log.warning("shutdown: %d sends were still waiting for fsync after the grace period", self.flusher.waiting)
        for task in self._timers:
            task.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
        try:
            await self.checkpoint()
        except (OSError, StoreError) as exc:
            log.error("shutdown: the final checkpoint failed: %s", exc)
        for conn in list(self.connections):
            conn.close()
        if self._server is not None:
            await self._server.wait_closed()
        if self._http is not None:
            await self._http.cleanup()
        await self.flusher.stop()
        self.store.close()


def _raise_fd_limit() -> None:
    # One consume log per subject is one open file: let the broker use what the system allows.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listen_error(what: str, host: str, port: int, exc: OSError, option: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{what} port {port} on {host} is already in use; choose another with {option} (0 picks a free one)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: it is not an address of this machine; use --host 127.0.0.1 or a local address"
    return f"cannot listen on {host}:{port}: {exc}"


def run_broker(config: BrokerConfig) -> int:
    """Run a broker until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves (and, with a meta server, is registered):
    ``qmq ready role=broker group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config))


async def _serve(config: BrokerConfig) -> int:
    import os

    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        broker = BrokerServer(config)
    except (StoreError, ConfigError, OSError) as exc:
        print(f"qmq broker: cannot start: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    try:
        await broker.start()
    except (StartupError, StoreError, ConfigError, OSError) as exc:
        print(f"qmq broker: cannot start: {exc}", file=sys.stderr, flush=True)
        await broker.stop()
        return EXIT_STARTUP_FAILED
    try:
        registered = asyncio.ensure_future(broker.wait_registered())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([registered, stopped], return_when=asyncio.FIRST_COMPLETED)
        registered.cancel()
        if not stop.is_set():
            print(
                f"qmq ready role=broker group={config.group} address={broker.address} "
                f"http={broker.http_url} pid={os.getpid()}",
                flush=True,
            )
            await stopped
        log.info("broker %s shutting down", broker.address)
    finally:
        await broker.stop()
    return 0
