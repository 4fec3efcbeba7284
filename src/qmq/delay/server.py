"""The delay server process: takes delay messages over the broker's SEND_MESSAGES contract,
keeps them in its store until they are due, hands them to brokers through the SDK's
producer, serves metrics, registers with the meta server as role "delay", and shuts down
in order.

Connections, group commit, registration and the process runner come from ``qmq.serving``.
Checkpoints run on their own worker thread so the write-ahead log's group commit never waits
behind them.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections import deque
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor

from aiohttp import web

from qmq.client.producer import Producer
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import DelayConfig
from qmq.common.errors import MetaServerError
from qmq.common.limits import DEFAULT_LIMITS, Limits, MiB
from qmq.delay.bucket import fsync_paths
from qmq.delay.dispatcher import Dispatcher
from qmq.delay.handlers import Handlers
from qmq.delay.metrics import CONTENT_TYPE, DelayMetrics
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.delay.timer import Rows
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.serving.connection import Connections, FrameConnection
from qmq.serving.group_commit import GroupCommit
from qmq.serving.registration import Registration, server_payload
from qmq.serving.runner import StartupError, listen_error, run_server, serve_http
from qmq.store.datadir import StoreError
from qmq.store.segments import FlushTicket

log = logging.getLogger(__name__)

_PRODUCER_APP_CODE = "qmq-delay"
# The hand-over producer's frames: large, several in flight per broker group.
_HANDOVER_BATCH_MESSAGES = 2_000
_HANDOVER_FRAMES_IN_FLIGHT = 8
_HANDOVER_SEND_TIMEOUT_MS = 10_000
# Route look-ups of new subjects running at once; past it, hand-overs look routes up themselves.
_PREPARING_MAX = 16


class DelayServer:
    # At most one send frame is handled per loop turn: the rest of what arrived waits for the
    # next turn, so a burst of sends delays due messages by one frame's work, not a burst's.
    yield_after: frozenset[int] = frozenset({RequestCode.SEND_MESSAGES})

    def __init__(self, config: DelayConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits
        self.store = DelayStore(config, clock, limits)
        self.scheduler = Scheduler(self.store, config.preload_ms)
        self.metrics = DelayMetrics()
        self.flusher = GroupCommit(
            "the write-ahead log",
            lambda: FlushTicket(self.store.wal.segments.sync_fds(), self.store.wal.end),
            lambda _ticket: None,
            self.metrics.flush_seconds.observe,
            self._disk_failed,
        )
        self.handlers = Handlers(self)
        self.producer: Producer | None = None
        self.dispatcher: Dispatcher | None = None
        self.connections = Connections(config.connections_max, self.metrics.connections.set)
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
        self._syncing: asyncio.Future[None] | None = None  # a background fsync (sync_bytes)
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
            lead_ms=cfg.handover_lead_ms,
            messages_max=cfg.handover_messages_max,
            bytes_max=cfg.handover_bytes_max,
            on_disk_error=self._disk_failed,
        )
        self.metrics.watch(self.scheduler, self.dispatcher)
        try:
            self._server = await loop.create_server(lambda: FrameConnection(self), cfg.host, cfg.port, backlog=1024)
        except OSError as exc:
            raise StartupError(listen_error("delay server", cfg.host, cfg.port, exc, "--port")) from None
        self.port = self._server.sockets[0].getsockname()[1]
        await self._serve_http()
        if cfg.flush == "periodic":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self._timers.append(loop.create_task(self._every(cfg.checkpoint_interval_ms, self.checkpoint)))
        self.dispatcher.start()
        self._registration = Registration(
            cfg.meta_server,
            server_payload("delay", cfg.group, self.address, f"{cfg.host}:{self.http_port}"),
            cfg.heartbeat_interval_ms,
        )
        self._registration.start()

    async def _serve_http(self) -> None:
        cfg = self.config
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._http, self.http_port = await serve_http(app, cfg.host, cfg.http_port, "metrics", "--http-port")

    def ready_line(self) -> str:
        return (
            f"qmq ready role=delay group={self.config.group} address={self.address} "
            f"http={self.http_url} pid={os.getpid()}"
        )

    # -- connections (qmq.serving.connection.ConnectionHost) ---------------------------

    def admit(self, conn: FrameConnection) -> bool:
        return self.connections.admit(conn)

    def dispatch(self, conn: FrameConnection, frame: Frame) -> None:
        self.handlers.dispatch(conn, frame)

    async def wait_registered(self) -> None:
        if self._registration is not None:
            await self._registration.registered.wait()

    async def _every(self, interval_ms: int, job: Callable[[], Awaitable[None]]) -> None:
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

    def forget(self, conn: FrameConnection) -> None:
        self.connections.forget(conn)

    def sync_in_background(self) -> None:
        """fsync, on the checkpoint thread, the schedule logs written ``sync_bytes`` past their
        last fsync: after a burst, a checkpoint would otherwise fsync all of it at once, and the
        disk's queue would hold up the fsyncs of sends and hand-overs for tens of milliseconds.
        One at a time; files that come due meanwhile wait for the next."""
        if self._syncing is not None or self.disk_error is not None:
            return
        paths = self.store.take_sync_due()
        if paths:
            fut = asyncio.get_running_loop().run_in_executor(self._checkpoint_executor, fsync_paths, paths)
            self._syncing = fut
            fut.add_done_callback(self._synced)

    def _synced(self, fut: asyncio.Future[None]) -> None:
        self._syncing = None
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            # what a failed fsync held may be lost even if a later fsync succeeds: stop taking sends
            self._disk_failed(exc)
        else:
            self.metrics.background_syncs.inc()
            if not self.stopping:
                self.sync_in_background()

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
        if self._syncing is not None:
            await asyncio.gather(self._syncing, return_exceptions=True)
        if self._checkpointing is not None and self.disk_error is None:
            try:
                await self.checkpoint()
            except (OSError, StoreError) as exc:
                log.error("shutdown: the final checkpoint failed: %s", exc)
        self.connections.close_all()
        if self._server is not None:
            await self._server.wait_closed()
        if self._http is not None:
            await self._http.cleanup()
        if self.producer is not None:
            await self.producer.close()
        await self.flusher.stop()
        self._checkpoint_executor.shutdown(wait=True)
        self.store.close()


def run_delay(config: DelayConfig) -> int:
    """Run a delay server until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves and is registered with the meta server:
    ``qmq ready role=delay group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    return run_server("delay", lambda: DelayServer(config))
