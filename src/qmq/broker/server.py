"""The broker process: listens for clients, serves metrics, registers with the meta server,
checkpoints, applies retention and moves silent consumers' messages to retry on timers, and
shuts down in order. Connections, group commit, registration and the process runner come
from ``qmq.serving``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from aiohttp import web

from qmq.broker.handlers import Handlers
from qmq.broker.metrics import CONTENT_TYPE, BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.broker.release import Release
from qmq.broker.replication import ReplicationSource, Replicator
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import BrokerConfig
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.common.naming import RETRY_PREFIX
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.serving.connection import Connections, FrameConnection
from qmq.serving.group_commit import GroupCommit
from qmq.serving.registration import Registration, server_payload
from qmq.serving.runner import StartupError, listen_error, run_server, serve_http
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import StoreError
from qmq.store.redelivery import expire_silent_consumers
from qmq.store.replica import rewind
from qmq.store.retention import run_retention
from qmq.store.segments import FlushTicket, fsync_dir

log = logging.getLogger(__name__)

_EPOCH_FILE = "epoch"


class BrokerServer:
    # after a send frame, the rest of what a connection sent waits a loop turn: fair to the others
    yield_after: frozenset[int] = frozenset({RequestCode.SEND_MESSAGES})

    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits | None = None) -> None:
        self.config = config
        self.clock = clock
        self.limits = limits = limits or dataclasses.replace(DEFAULT_LIMITS, message_bytes_max=config.message_bytes_max)
        self.store = BrokerStore(config, clock, limits)
        self.metrics = BrokerMetrics(self.store)
        self.parked = ParkedPulls(self.store, self.metrics.waiting_pulls.set)
        self.flusher = GroupCommit(
            "the message log",
            self.store.begin_flush,
            self._flushed,
            self.metrics.flush_seconds.observe,
            self._disk_failed,
        )
        self.role: str = config.role
        self.epoch = _read_epoch(self.store.dir)
        self.source = ReplicationSource(lambda: self.store, config)
        self.store.on_grow = self.source.grew
        self.replicator: Replicator | None = None
        self._transition: asyncio.Task[None] | None = None
        self.handlers = Handlers(self)
        self.release = Release(self)
        self.connections = Connections(config.connections_max, self.metrics.connections.set)
        self.stopping = False
        self.port = 0
        self.http_port = 0
        self._server: asyncio.Server | None = None
        self._http: web.AppRunner | None = None
        self._registration: Registration | None = None
        self._timers: list[asyncio.Task[None]] = []
        self._checkpointing: asyncio.Lock | None = None
        # A checkpoint fsyncs every consume log written since the last one: on the group commit's
        # thread, sends waiting for their fsync would wait behind it.
        self._checkpoint_executor = ThreadPoolExecutor(1, thread_name_prefix="qmq-checkpoint")

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        return f"http://{self.config.host}:{self.http_port}"

    def ready_line(self) -> str:
        import os

        return (
            f"qmq ready role=broker group={self.config.group} address={self.address} "
            f"http={self.http_url} pid={os.getpid()}"
        )

    # -- connections (qmq.serving.connection.ConnectionHost) ---------------------------

    def admit(self, conn: FrameConnection) -> bool:
        return self.connections.admit(conn)

    def dispatch(self, conn: FrameConnection, frame: Frame) -> None:
        self.handlers.dispatch(conn, frame)

    def forget(self, conn: FrameConnection) -> None:
        self.connections.forget(conn)
        self.parked.drop_owner(conn)
        self.source.forget(conn)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Recover the store, listen, serve metrics, and (with a meta server) register."""
        report = self.store.open()
        log.info("store recovered: %s", report)
        self.flusher.flushed_offset = self.store.mlog.end
        self._checkpointing = asyncio.Lock()
        loop = asyncio.get_running_loop()
        cfg = self.config
        try:
            self._server = await loop.create_server(lambda: FrameConnection(self), cfg.host, cfg.port, backlog=1024)
        except OSError as exc:
            raise StartupError(listen_error("broker", cfg.host, cfg.port, exc, "--port")) from None
        self.port = self._server.sockets[0].getsockname()[1]
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._http, self.http_port = await serve_http(app, cfg.host, cfg.http_port, "metrics", "--http-port")
        if cfg.flush == "periodic" or self.role == "slave":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self.release.schedule()  # what was held when the broker stopped is due by now, or soon
        self._timers.append(loop.create_task(self._every(cfg.checkpoint_interval_ms, self.checkpoint)))
        self._timers.append(loop.create_task(self._every(cfg.retention_check_interval_ms, self._retention)))
        silent_check_ms = max(10, min(cfg.consumer_offline_ms // 4, 5_000))
        self._timers.append(loop.create_task(self._every(silent_check_ms, self._expire_silent)))
        slave_check_ms = max(10, min(cfg.slave_timeout_ms // 4, 1_000))
        self._timers.append(loop.create_task(self._every(slave_check_ms, self._check_slaves)))
        if cfg.meta_server:
            self._registration = Registration(
                cfg.meta_server, self._heartbeat, cfg.heartbeat_interval_ms, on_answer=self._on_answer
            )
            self._registration.start()
        elif self.role == "slave":
            raise StartupError("a slave needs --meta-server: the meta server names its master")

    async def wait_registered(self) -> None:
        if self._registration is not None:
            await self._registration.registered.wait()

    async def _every(self, interval_ms: int, job: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_ms / 1000)  # the job's period
            try:
                await job()
            except Exception:  # a failed checkpoint or retention run is retried next time
                log.exception("periodic %s failed", getattr(job, "__name__", job))

    # -- roles in the group (docs/cluster.md) --------------------------------------------

    def _heartbeat(self) -> dict[str, object]:
        cfg = self.config
        payload: dict[str, object] = server_payload("broker", cfg.group, self.address, f"{cfg.host}:{self.http_port}")
        payload.update(
            role_in_group=self.role,
            epoch=self.epoch,
            log_end=self.store.mlog.end,
            action_end=self.store.alog.end,
        )
        if self.role == "master":
            state = self.source.write_state()
            payload["write_state"] = {"alone": "ok", "replicated": "ok"}.get(state, state)
        elif self.replicator is not None:
            payload["replicated_ms"] = self.replicator.last_ms
        return payload

    def _on_answer(self, answer: dict[str, object]) -> None:
        role = answer.get("role_in_group")
        epoch = answer.get("epoch")
        if role not in ("master", "slave") or not isinstance(epoch, int) or self.stopping:
            return  # a meta server that does not manage roles: stay as started
        slaves = answer.get("slaves")
        self.source.slaves_reported = slaves if isinstance(slaves, int) else 0
        master = answer.get("master")
        truncate = answer.get("truncate")
        if self._transition is not None and not self._transition.done():
            return  # the last change is still being carried out; the next heartbeat says again
        if role == "master" and self.role == "slave":
            self._transition = asyncio.ensure_future(self._promote(epoch))
        elif role == "master":
            if epoch > self.epoch:
                self._set_epoch(epoch)
        elif isinstance(master, str) and master != self.address:
            cut = truncate if isinstance(truncate, dict) else None
            if self.role == "master" or self.replicator is None or self.replicator.master != master:
                self._transition = asyncio.ensure_future(self._follow(master, epoch, cut))

    async def _promote(self, epoch: int) -> None:
        log.warning("promoted to master of group %s in epoch %d", self.config.group, epoch)
        if self.replicator is not None:
            await self.replicator.stop()
            self.replicator = None
        self._set_epoch(epoch)
        self.source.started = time.monotonic()
        self.source.slaves.clear()
        self.source.replicated = self.store.mlog.end
        self.source.actions_replicated = self.store.alog.end
        self.flusher.flushed_offset = self.store.mlog.end
        self.role = "master"
        self.release.schedule()
        if self._registration is not None:
            self._registration.beat_now()

    async def _follow(self, master: str, epoch: int, truncate: dict[str, object] | None) -> None:
        """Become (or stay) a slave of ``master``: stop writes, cut what was never replicated, copy."""
        was_master = self.role == "master"
        self.role = "slave"
        self.release.cancel()
        if was_master:
            log.warning(
                "group %s has a new master %s in epoch %d; this broker follows it", self.config.group, master, epoch
            )
            self.source.fail_all(f"broker {self.address} is no longer master of group {self.config.group}; retry")
            self.parked.answer_all_empty()
            await self.flusher.drain(self.config.shutdown_grace_ms / 1000)
            if self.config.flush != "periodic":
                self.flusher.start_periodic(self.config.flush_interval_ms)
        if self.replicator is not None:
            await self.replicator.stop()
            self.replicator = None
        if truncate is not None:
            message_offset, action_offset = truncate.get("message_offset"), truncate.get("action_offset")
            if (
                isinstance(message_offset, int)
                and isinstance(action_offset, int)
                and (self.store.mlog.end > message_offset or self.store.alog.end > action_offset)
            ):
                assert self._checkpointing is not None
                async with self._checkpointing:
                    rewind(self.store, message_offset, action_offset)
        self._set_epoch(epoch)
        self.replicator = Replicator(lambda: self.store, master, epoch, self.address, lambda _subjects: None)
        self.replicator.start()
        if self._registration is not None:
            self._registration.beat_now()

    def _set_epoch(self, epoch: int) -> None:
        if epoch != self.epoch:
            self.epoch = epoch
            _write_epoch(self.store.dir, epoch)

    async def _check_slaves(self) -> None:
        if self.role == "master":
            self.source.check()

    def _flushed(self, ticket: FlushTicket) -> None:
        moved = self.store.complete_flush(ticket)
        if moved:
            self.parked.notify(moved)

    async def checkpoint(self) -> None:
        assert self._checkpointing is not None
        async with self._checkpointing:
            store = self.store
            state = store.checkpoint_state()
            ticket = store.begin_flush(consume_logs=True)
            await asyncio.get_running_loop().run_in_executor(
                self._checkpoint_executor, store.write_checkpoint, ticket, state
            )
            store.after_checkpoint(state)

    async def _retention(self) -> None:
        run_retention(self.store)

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
        body = {"ok": ok, "group": self.config.group, "role_in_group": self.role, "epoch": self.epoch}
        if self.role == "master":
            body["write_state"] = self.source.write_state()
        return web.json_response(body, status=200 if ok else 503)

    def _disk_failed(self, exc: BaseException) -> None:
        log.critical("the broker's disk failed (%s); it no longer takes sends", exc)

    async def stop(self) -> None:
        """Stop accepting, answer parked pulls, finish in-flight writes, flush, checkpoint, close."""
        if self.stopping:
            return
        self.stopping = True
        self.release.cancel()
        if self._server is not None:
            self._server.close()
        if self._registration is not None:
            await self._registration.stop()
        if self._transition is not None:
            await asyncio.gather(self._transition, return_exceptions=True)
        if self.replicator is not None:
            await self.replicator.stop()
        self.source.fail_all(f"broker {self.address} is shutting down; retry")
        self.parked.answer_all_empty()
        if not await self.flusher.drain(self.config.shutdown_grace_ms / 1000):
            log.warning("shutdown: %d sends were still waiting for fsync after the grace period", self.flusher.waiting)
        for task in self._timers:
            task.cancel()
        await asyncio.gather(*self._timers, return_exceptions=True)
        if self._checkpointing is not None:
            try:
                await self.checkpoint()
            except (OSError, StoreError) as exc:
                log.error("shutdown: the final checkpoint failed: %s", exc)
        self.connections.close_all()
        if self._server is not None:
            await self._server.wait_closed()
        if self._http is not None:
            await self._http.cleanup()
        await self.flusher.stop()
        self._checkpoint_executor.shutdown(wait=True)
        self.store.close()


def _read_epoch(directory: Path) -> int:
    try:
        value = json.loads((directory / _EPOCH_FILE).read_text())
    except (FileNotFoundError, ValueError):
        return 0
    return int(value.get("epoch", 0)) if isinstance(value, dict) else 0


def _write_epoch(directory: Path, epoch: int) -> None:
    tmp = directory / (_EPOCH_FILE + ".tmp")
    tmp.write_text(json.dumps({"epoch": epoch}))
    os.replace(tmp, directory / _EPOCH_FILE)
    fsync_dir(directory)


def run_broker(config: BrokerConfig) -> int:
    """Run a broker until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves (and, with a meta server, is registered):
    ``qmq ready role=broker group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    return run_server("broker", lambda: BrokerServer(config))
