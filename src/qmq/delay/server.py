"""The delay server process: takes delay messages over the broker's SEND_MESSAGES contract,
keeps them in its store until they are due, hands them to brokers through the SDK's
producer, serves metrics, registers with the meta server as role "delay", and shuts down
in order.

Each connection is an ``asyncio.Protocol`` feeding a sans-IO ``FrameDecoder``; requests are
handled on the loop as they are decoded. Checkpoints run on their own worker thread so the
write-ahead log's group commit never waits behind them.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import logging
import os
import resource
import signal
import socket
import sys
from collections import deque
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import uvloop
from aiohttp import web

from qmq.client.producer import Producer
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import DelayConfig
from qmq.common.errors import ConfigError, MetaServerError
from qmq.common.limits import DEFAULT_LIMITS, Limits, MiB
from qmq.delay.dispatcher import Dispatcher
from qmq.delay.flusher import WalFlusher
from qmq.delay.handlers import Handlers
from qmq.delay.metrics import CONTENT_TYPE, DelayMetrics
from qmq.delay.registration import Registration, delay_payload
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore, StoreError
from qmq.delay.timer import Rows
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import FrameDecoder, encode_frame_parts

log = logging.getLogger(__name__)

EXIT_STARTUP_FAILED = 3
_PRODUCER_APP_CODE = "qmq-delay"
# The hand-over producer's frames: large, several in flight per broker group.
_HANDOVER_BATCH_MESSAGES = 2_000
_HANDOVER_FRAMES_IN_FLIGHT = 8
_HANDOVER_SEND_TIMEOUT_MS = 10_000
# Route look-ups of new subjects running at once; past it, hand-overs look routes up themselves.
_PREPARING_MAX = 16


class StartupError(Exception):
    """The delay server cannot start; the text says why and what to do."""


class DelayConnection(asyncio.Protocol):
    """One client connection. At most one send frame is handled per loop turn: the rest of what
    arrived waits (reading paused) for the next turn, so the firing loop runs between frames
    and a burst of sends delays due messages by one frame's work, not by a whole burst's."""

    def __init__(self, server: DelayServer) -> None:
        self.server = server
        self.decoder = FrameDecoder(server.limits)
        self.transport: asyncio.Transport | None = None
        self.peer = "?"
        self.closed = False
        self._flow_paused = False  # the client reads our answers too slowly
        self._turn_paused = False  # frames left for the next loop turn

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's TCPTransport is not a subclass
        peer = transport.get_extra_info("peername")
        self.peer = f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)
        server = self.server
        if len(server.connections) >= server.config.connections_max:
            log.warning(
                "refusing connection from %s: connections_max %d reached", self.peer, server.config.connections_max
            )
            transport.close()
            self.closed = True
            return
        server.connections.add(self)
        server.metrics.connections.set(len(server.connections))

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
        dispatch = self.server.handlers.dispatch
        try:
            while not self.closed and (frame := decoder.next_frame()) is not None:
                if frame.response:
                    raise RemoteProtocolError("a client sent a response frame; only requests are accepted")
                dispatch(self, frame)
                if frame.code == RequestCode.SEND_MESSAGES and decoder.buffered_bytes:
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
        # The client reads slower than we answer: stop reading its requests until it catches up.
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
        self.server.forget(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.server.forget(self)


class DelayServer:
    def __init__(self, config: DelayConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        _raise_fd_limit()
        self.store = DelayStore(config, clock, limits)
        self.scheduler = Scheduler(self.store, config.preload_ms)
        self.metrics = DelayMetrics()
        self.flusher = WalFlusher(self.store, self.metrics.flush_seconds.observe, self._disk_failed)
        self.handlers = Handlers(self)
        self.producer: Producer | None = None
        self.dispatcher: Dispatcher | None = None
        self.connections: set[DelayConnection] = set()
        # sync policy: timer rows of sends waiting for their fsync, by write-ahead log end offset
        self.unflushed: deque[tuple[int, Rows]] = deque()
        self.disk_error: BaseException | None = None
        self.stopping = False
        self.port = 0
        self.http_port = 0
        self._server: asyncio.Server | None = None
        self._http: web.AppRunner | None = None
        self._registration: Registration | None = None
        self._timers: list[asyncio.Task[None]] = []
        self._checkpointing: asyncio.Lock | None = None
        self._checkpoint_executor = ThreadPoolExecutor(1, thread_name_prefix="qmq-delay-checkpoint")
        self._preparing: set[asyncio.Task[None]] = set()

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    async def start(self) -> None:
        """Recover the store, connect to the brokers, listen, serve metrics, register."""
        cfg = self.config
        if not cfg.meta_server:
            raise StartupError(
                "a delay server needs --meta-server: it hands due messages to the brokers the meta server lists"
            )
        report = self.store.open()
        log.info("delay store recovered: %s", report)
        # what recovery found is on disk already; only later writes wait for an fsync
        self.flusher.flushed_offset = self.store.wal.end
        self._checkpointing = asyncio.Lock()
        loop = asyncio.get_running_loop()
        producer = Producer(
            app_code=_PRODUCER_APP_CODE,
            meta_server=cfg.meta_server,
            buffer_messages_max=cfg.handover_messages_max + _HANDOVER_BATCH_MESSAGES,
            buffer_bytes_max=cfg.handover_bytes_max + 8 * MiB,
            batch_messages_max=_HANDOVER_BATCH_MESSAGES,
            max_in_flight=_HANDOVER_FRAMES_IN_FLIGHT,
            send_timeout_ms=_HANDOVER_SEND_TIMEOUT_MS,
        )
        try:
            await producer.start()
        except MetaServerError as exc:
            raise StartupError(f"cannot reach the meta server to find brokers: {exc}") from None
        self.producer = producer
        await producer.prepare()  # connect to the brokers before the first message is due
        self.dispatcher = Dispatcher(
            self.scheduler,
            producer,
            self.clock,
            messages_max=cfg.handover_messages_max,
            bytes_max=cfg.handover_bytes_max,
            on_disk_error=self._disk_failed,
        )
        self.metrics.watch(self.scheduler, self.dispatcher)
        try:
            self._server = await loop.create_server(lambda: DelayConnection(self), cfg.host, cfg.port, backlog=1024)
        except OSError as exc:
            raise StartupError(_listen_error("delay server", cfg.host, cfg.port, exc, "--port")) from None
        self.port = self._server.sockets[0].getsockname()[1]
        await self._serve_http()
        if cfg.flush == "periodic":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self._timers.append(loop.create_task(self._every(cfg.checkpoint_interval_ms, self.checkpoint)))
        self.dispatcher.start()
        self._registration = Registration(
            cfg.meta_server,
            delay_payload(cfg.group, self.address, f"{cfg.host}:{self.http_port}"),
            cfg.heartbeat_interval_ms,
        )
        self._registration.start()

    async def _serve_http(self) -> None:
        cfg = self.config
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

    async def wait_registered(self) -> None:
        if self._registration is not None:
            await self._registration.registered.wait()

    async def _every(self, interval_ms: int, job: Any) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000)  # the job's period
            try:
                await job()
            except Exception:  # a failed checkpoint is retried next time
                log.exception("periodic %s failed", getattr(job, "__name__", job))

    async def checkpoint(self) -> None:
        """Make the schedule logs durable, record the write-ahead log offset they cover, and delete
        what that makes unneeded: replayed log segments and finished buckets."""
        assert self._checkpointing is not None
        async with self._checkpointing:
            job = self.store.checkpoint_job()
            await asyncio.get_running_loop().run_in_executor(self._checkpoint_executor, job.run)
            segments = self.store.after_checkpoint(job)
            gone = self.scheduler.remove_finished(self.clock.now_ms())
            if segments or gone:
                log.info(
                    "checkpoint at write-ahead log offset %d: deleted %d log segment(s) and %d finished bucket(s)",
                    job.wal_offset,
                    segments,
                    len(gone),
                )

    def prepare_routes(self, subjects: list[str]) -> None:
        """Look up the routes of subjects new to this server now, long before their messages are due."""
        producer = self.producer
        if producer is None or len(self._preparing) >= _PREPARING_MAX or self.stopping:
            return  # the hand-over will look them up itself
        task = asyncio.ensure_future(producer.prepare(subjects))
        self._preparing.add(task)
        task.add_done_callback(self._prepared)

    def _prepared(self, task: asyncio.Task[None]) -> None:
        self._preparing.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.debug("looking up routes ahead of time failed: %s", task.exception())

    def poke_dispatcher(self) -> None:
        if self.dispatcher is not None:
            self.dispatcher.poke()

    def arrived(self, rows: Rows) -> None:
        if self.dispatcher is not None and len(rows):
            self.dispatcher.arrived(rows)

    def release_durable(self) -> None:
        """Hand the timer the rows of sends whose write-ahead log records are now fsynced."""
        flushed = self.flusher.flushed_offset
        unflushed = self.unflushed
        while unflushed and unflushed[0][0] <= flushed:
            self.arrived(unflushed.popleft()[1])

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": CONTENT_TYPE})

    async def _health(self, _request: web.Request) -> web.Response:
        ok = not self.stopping and self.flusher.failed is None and self.disk_error is None
        return web.json_response({"ok": ok, "group": self.config.group}, status=200 if ok else 503)

    def forget(self, conn: DelayConnection) -> None:
        if conn in self.connections:
            self.connections.discard(conn)
            self.metrics.connections.set(len(self.connections))

    def _disk_failed(self, exc: BaseException) -> None:
        if self.disk_error is None:
            self.disk_error = exc
        log.critical("the delay server's disk failed (%s); it no longer takes sends", exc)

    async def stop(self) -> None:
        """Stop accepting, finish in-flight writes, stop firing (waiting for hand-overs in flight),
        checkpoint, close."""
        if self.stopping:
            return
        self.stopping = True
        grace_s = self.config.shutdown_grace_ms / 1000
        if self._server is not None:
            self._server.close()
        if self._registration is not None:
            await self._registration.stop()
        for task in list(self._preparing):
            task.cancel()
        if not await self.flusher.drain(grace_s):
            log.warning("shutdown: %d sends were still waiting for fsync after the grace period", self.flusher.waiting)
        if self.dispatcher is not None:
            await self.dispatcher.stop(grace_s)
        for task in self._timers:
            task.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
        if self._checkpointing is not None and self.disk_error is None:
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
        if self.producer is not None:
            await self.producer.close()
        await self.flusher.stop()
        self._checkpoint_executor.shutdown(wait=True)
        self.store.close()


_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MALLOC_THRESHOLD_BYTES = 256 * 1024


def _return_freed_memory() -> None:
    """Have glibc give large freed blocks (frames, batch buffers, timer merges) back to the system.

    By default glibc raises its mmap threshold after large blocks are freed, so later large
    blocks come from the heap and the resident size keeps the high-water mark of every burst.
    Fixed thresholds keep it close to what the timer and the buffers hold now.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def _raise_fd_limit() -> None:
    # Schedule logs being written and client connections are open files: use what the system allows.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _listen_error(what: str, host: str, port: int, exc: OSError, option: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{what} port {port} on {host} is already in use; choose another with {option} (0 picks a free one)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: it is not an address of this machine; use --host 127.0.0.1 or a local address"
    return f"cannot listen on {host}:{port}: {exc}"


def run_delay(config: DelayConfig) -> int:
    """Run a delay server until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves and is registered with the meta server:
    ``qmq ready role=delay group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    _return_freed_memory()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config))


async def _serve(config: DelayConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = DelayServer(config)
    except (StoreError, ConfigError, OSError) as exc:
        print(f"qmq delay: cannot start: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    try:
        await server.start()
    except (StartupError, StoreError, ConfigError, OSError) as exc:
        print(f"qmq delay: cannot start: {exc}", file=sys.stderr, flush=True)
        await server.stop()
        return EXIT_STARTUP_FAILED
    # What start-up made lives as long as the process: keep it out of the collector's full passes,
    # which would otherwise pause the firing loop for longer as it grows.
    gc.freeze()
    try:
        registered = asyncio.ensure_future(server.wait_registered())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([registered, stopped], return_when=asyncio.FIRST_COMPLETED)
        registered.cancel()
        if not stop.is_set():
            print(
                f"qmq ready role=delay group={config.group} address={server.address} "
                f"http={server.http_url} pid={os.getpid()}",
                flush=True,
            )
            await stopped
        log.info("delay server %s shutting down", server.address)
    finally:
        await server.stop()
    return 0
