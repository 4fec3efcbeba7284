"""The delay server process: takes delay messages over the broker's SEND_MESSAGES contract,
keeps them in its store until they are due, hands them to brokers through the SDK's
producer, serves metrics, registers with the meta server as role "delay", and shuts down
in order. In a delay group with slaves it is master or slave as the meta server says
(docs/cluster.md, "Delay groups"): a slave copies its master's write-ahead log and
dispatch logs (replica.py) and hands nothing over; a master hands over only once the meta
server has said, in its answer to this process's first report, that it is master in the
group's epoch, so an old master restarted after a promotion never fires on its own.

The listening shell, dispatch, group commit, registration and the process runner come from
``qmq.serving``; what each request does is in ``qmq.delay.handlers``. Checkpoints run on
their own worker thread so the write-ahead log's group commit never waits behind them.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque

from qmq.client.connection import Connection
from qmq.client.producer import Producer
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import DelayConfig
from qmq.common.errors import MetaServerError
from qmq.common.limits import DEFAULT_LIMITS, Limits, MiB
from qmq.delay.bucket import fsync_paths
from qmq.delay.dispatcher import Dispatcher
from qmq.delay.handlers import Handlers
from qmq.delay.metrics import DelayMetrics
from qmq.delay.replica import SlaveCopy, master_token, read_for_slave
from qmq.delay.resync import Resync
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.delay.timer import Rows
from qmq.serving.connection import FrameConnection
from qmq.serving.group_commit import GroupCommit
from qmq.serving.group_role import GroupMember
from qmq.serving.replication import ReplicationSource, Replicator
from qmq.serving.replies import Reply
from qmq.serving.runner import StartupError, run_server
from qmq.serving.server import FrameServer
from qmq.serving.tracing import server_tracing
from qmq.store.segments import FlushTicket

log = logging.getLogger(__name__)

_PRODUCER_APP_CODE = "qmq-delay"
# The hand-over producer's frames: large, several in flight per broker group.
_HANDOVER_BATCH_MESSAGES = 2_000
_HANDOVER_FRAMES_IN_FLIGHT = 8
_HANDOVER_SEND_TIMEOUT_MS = 10_000
# Route look-ups of new subjects running at once; past it, hand-overs look routes up themselves.
_PREPARING_MAX = 16
_CONNECT_TIMEOUT_MS = 3000  # to the group's master, as a slave
# A master keeps the write-ahead log segments a slave has not copied while that slave was seen
# this recently (or, after a promotion, this long for the old master to come back and follow).
_SLAVE_ABSENT_S_MAX = 3600.0


class DelayServer(FrameServer, GroupMember):
    kind = "delay"
    title = "delay server"
    config: DelayConfig
    store: DelayStore
    metrics: DelayMetrics

    def __init__(self, config: DelayConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits = DEFAULT_LIMITS) -> None:
        self.store = DelayStore(config, clock, limits)
        self.store.on_disk_error = self._disk_failed  # a schedule log that failed (delay/schedule.py)
        self.metrics = DelayMetrics()
        super().__init__(config, limits, self.metrics.connections.set, "qmq-delay-checkpoint")
        self.clock = clock
        self.tracing = server_tracing(
            config.trace_spans, config.trace_sample_ratio, config.trace_endpoint, "delay", config.group
        )
        self.scheduler = Scheduler(self.store, config.preload_ms)
        self.flusher = GroupCommit(
            "the write-ahead log",
            lambda: FlushTicket(self.store.wal.segments.sync_fds(), self.store.wal.end),
            lambda _ticket: None,
            self.metrics.flush_seconds.observe,
            self._disk_failed,
        )
        self.producer: Producer | None = None
        self.dispatcher: Dispatcher | None = None
        # sync policy: timer rows of sends waiting for their fsync, by write-ahead log end offset
        self.unflushed: deque[tuple[int, Rows]] = deque()
        self.disk_error: BaseException | None = None
        self._syncing: asyncio.Future[None] | None = None  # a background fsync (sync_bytes)
        self._preparing: set[asyncio.Task[None]] = set()
        self._start_in_role(self.store.dir, config.role, "delay server", config.group)
        self.token = master_token()
        self.source = ReplicationSource(
            lambda h: read_for_slave(self.store, self.token, h), config, lambda: (self.store.wal.end, 0), "delay group"
        )
        self.store.on_grow = self.source.grew
        self.replicator: Replicator | None = None
        self.copy: SlaveCopy | None = None
        self.kept_from: int | None = None  # the write-ahead log offset this master began its epoch at
        self.handlers = Handlers(self)
        self.dispatch = self.handlers.dispatch

    def forget(self, conn: FrameConnection) -> None:
        super().forget(conn)
        self.source.forget(conn)

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
        self.checkpointing = asyncio.Lock()
        producer = Producer(
            app_code=cfg.app_code or _PRODUCER_APP_CODE,
            secret=self.secret(),
            ssl=self.tls_out,
            meta_server=cfg.meta_server,
            buffer_messages_max=cfg.handover_messages_max + _HANDOVER_BATCH_MESSAGES,
            buffer_bytes_max=cfg.handover_bytes_max + 8 * MiB,
            batch_messages_max=_HANDOVER_BATCH_MESSAGES,
            max_in_flight=_HANDOVER_FRAMES_IN_FLIGHT,
            send_timeout_ms=_HANDOVER_SEND_TIMEOUT_MS,
            # a hand-over may repeat one made before a restart: only to the group that stored it
            resends=True,
        )
        try:
            await producer.start()
        except MetaServerError as exc:
            raise StartupError(f"cannot reach the meta server to find brokers: {exc}") from None
        self.producer = producer
        await producer.prepare()  # connect to the brokers before the first message is due
        self.metrics.watch(self.scheduler, lambda: self.dispatcher)
        await self.listen()
        if cfg.flush == "periodic" or self.role == "slave":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self.periodic.every(cfg.checkpoint_interval_ms, self.checkpoint)
        self.periodic.every(max(10, min(cfg.slave_timeout_ms // 4, 1_000)), self._check_slaves)
        # the dispatcher starts once the meta server's answer says this server is master (_on_answer)
        self.register(self._heartbeat, on_answer=self._on_answer)

    def _start_dispatcher(self) -> None:
        assert self.producer is not None
        cfg = self.config
        self.dispatcher = Dispatcher(
            self.scheduler,
            self.producer,
            self.clock,
            lead_ms=cfg.handover_lead_ms,
            messages_max=cfg.handover_messages_max,
            bytes_max=cfg.handover_bytes_max,
            on_disk_error=self._disk_failed,
            tracing=self.tracing,
        )
        self.dispatcher.start()

    # -- roles in the group (docs/cluster.md, "Delay groups") --------------------

    def _on_answer(self, answer: dict[str, object]) -> None:
        if self.stopping or answer.get("role_in_group") not in ("master", "slave"):
            return
        self._take_orders(answer)
        # confirmed master of the group's epoch (or a newer one): hand over
        if self.role == "master" and self.dispatcher is None and (self._transition is None or self._transition.done()):
            self._set_epoch(self.epoch or 1, "master")
            self._start_dispatcher()

    async def _promote(self, epoch: int) -> None:
        log.warning("promoted to master of delay group %s in epoch %d", self.config.group, epoch)
        if self.replicator is not None:
            await self.replicator.stop()
            self.replicator = None
            self.copy = None
        self._set_epoch(epoch, "master")
        end = self.store.wal.end
        self.source.reset(end, 0)
        self.kept_from = end
        self.flusher.flushed_offset = end
        self.store.flush_buffers()  # the buckets it loads are read from their files
        self.role = "master"
        if self.dispatcher is None:
            self._start_dispatcher()
        if self._registration is not None:
            self._registration.beat_now()

    async def _follow(self, master: str, epoch: int, truncate: dict[str, object] | None) -> None:
        """Become (or stay) a slave of ``master``: stop handing over, cut what was never replicated, copy."""
        was_master = self.role == "master"
        self.role = "slave"
        if was_master:
            log.warning(
                "delay group %s has a new master %s in epoch %d; this delay server follows it and hands nothing over",
                self.config.group,
                master,
                epoch,
            )
            self.source.fail_all(f"delay server {self.address} is no longer master of group {self.config.group}; retry")
            grace_s = self.config.shutdown_grace_ms / 1000
            await self.drain_writes(grace_s)
            if self.dispatcher is not None:
                await self.dispatcher.stop(grace_s)
                self.dispatcher = None
            self.scheduler.unload_all()
            if self.config.flush != "periodic":
                self.flusher.start_periodic(self.config.flush_interval_ms)
        if self.replicator is not None:
            await self.replicator.stop()
            self.replicator = None
        wal_offset = None if truncate is None else truncate.get("message_offset")
        if isinstance(wal_offset, int) and self.store.wal.end > wal_offset:
            assert self.checkpointing is not None
            async with self.checkpointing:
                report = self.store.rewind(wal_offset)
            log.warning("cut back to where epoch %d began: %s", epoch, report)
            self.flusher.flushed_offset = self.store.wal.end
            self.unflushed.clear()
        self._set_epoch(epoch, "slave")
        self.copy = SlaveCopy(self.store, self._install_copy)
        conn = Connection(
            master, connect_timeout_ms=_CONNECT_TIMEOUT_MS, credentials=self.credentials(), ssl=self.tls_out
        )
        self.replicator = Replicator(master, epoch, self.address, conn, self.copy.ask, self.copy.take)
        self.replicator.start()
        if self._registration is not None:
            self._registration.beat_now()

    async def _install_copy(self, resync: Resync) -> None:
        """Swap in the copy of the master's schedule a slave behind its master's log made (resync.py)."""
        assert self.checkpointing is not None
        assert resync.checkpoint is not None
        async with self.checkpointing:  # no checkpoint of the store being swapped out meanwhile
            report = self.store.install_copy(resync.staging, resync.checkpoint)
        self.flusher.flushed_offset = self.store.wal.end
        self.unflushed.clear()
        log.warning("swapped in a copy of the master's schedule (%d bytes): %s", resync.copied_bytes, report)

    def after_replicated(self, end: int, reply: Reply, replicated: Reply | None = None) -> None:
        """``reply`` once the write-ahead log up to ``end`` is durable here (with the fsync's
        error, if any) and then ``replicated`` (``reply`` when not given) once it is (with a slave
        and ``wait_slave_wrote``) written on the slave, or with why it will not be: no longer
        master, stopping, read-only."""

        def durable(error: str | None) -> None:
            if error is not None:
                reply(error)
            else:
                self.source.after_log_replicated(end, replicated or reply)

        if self.store.sync_policy:
            self.flusher.after_write(end, durable)
        else:
            durable(None)

    async def checkpoint(self) -> None:
        """Make the schedule logs durable, record the write-ahead log offset they cover, and delete
        what that makes unneeded: replayed log segments and finished buckets."""
        assert self.checkpointing is not None
        async with self.checkpointing:
            job = self.store.checkpoint_job()
            await asyncio.get_running_loop().run_in_executor(self.checkpoint_executor, job.run)
            keep_from = None
            if self.role == "master":
                keep_from = self.source.lowest_kept(_SLAVE_ABSENT_S_MAX)
                if keep_from is None and time.monotonic() - self.source.started < _SLAVE_ABSENT_S_MAX:
                    keep_from = self.kept_from  # for the old master, back after a promotion
            segments = self.store.after_checkpoint(job, keep_from)
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

    def write_state(self) -> str:
        """What a send meets: "ok", "failed" (a write or an fsync failed: no sends until a restart),
        "disk-full" (clears by itself once space is freed), "read-only" or "degraded" (the slave
        is gone: docs/cluster.md)."""
        if self.flusher.failed is not None or self.disk_error is not None:
            return "failed"
        if self.handlers.free_space.low() is not None:
            return "disk-full"
        state = self.source.write_state()
        return {"alone": "ok", "replicated": "ok"}.get(state, state)

    def health(self) -> dict[str, object]:
        failed = self.flusher.failed or self.disk_error
        body: dict[str, object] = {
            "ok": not self.stopping and failed is None,
            "group": self.config.group,
            "role_in_group": self.role,
            "epoch": self.epoch,
        }
        if self.role == "master":
            body["write_state"] = self.write_state()
        elif self.copy is not None and self.copy.resync is not None:
            # behind its master's log: copying its schedule anew, no promotion candidate until done
            body["copying_anew_bytes"] = self.copy.resync.copied_bytes
        if failed is not None:
            body["error"] = f"the delay server's disk failed ({failed}); restart it"
        elif (low := self.handlers.free_space.low()) is not None:
            body["error"] = low
        return body

    def _heartbeat(self) -> dict[str, object]:
        payload: dict[str, object] = {
            **self.registration_payload(),
            "role_in_group": self.role,
            "epoch": self.epoch,
            "log_end": self.store.wal.end,
            "action_end": 0,
        }
        if self.role == "master":
            payload["write_state"] = self.write_state()
        elif self.replicator is not None:
            # while copying the master's schedule anew it has half a copy: never a promotion candidate
            resyncing = self.copy is not None and self.copy.resyncing
            payload["replicated_ms"] = 0 if resyncing else self.replicator.last_ms
        return payload

    def sync_in_background(self) -> None:
        """fsync, on the checkpoint thread, the schedule logs written ``sync_bytes`` past their
        last fsync: after a burst, a checkpoint would otherwise fsync all of it at once, and the
        disk's queue would hold up the fsyncs of sends and hand-overs for tens of milliseconds.
        One at a time; files that come due meanwhile wait for the next."""
        if self._syncing is not None or self.disk_error is not None:
            return
        paths = self.store.take_sync_due()
        if paths:
            fut = asyncio.get_running_loop().run_in_executor(self.checkpoint_executor, fsync_paths, paths)
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
        await self.stop_listening()
        await self._end_transition()
        if self.replicator is not None:
            await self.replicator.stop()
        self.source.fail_all(f"delay server {self.address} is shutting down; retry")
        for task in list(self._preparing):
            task.cancel()
        await self.drain_writes(grace_s)
        if self.dispatcher is not None:
            await self.dispatcher.stop(grace_s)
        await self.periodic.stop()
        if self._syncing is not None:
            await asyncio.gather(self._syncing, return_exceptions=True)
        if self.disk_error is None:
            await self.final_checkpoint()
        await self.close_connections()
        if self.producer is not None:
            await self.producer.close()
        await self.close_store()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


def run_delay(config: DelayConfig) -> int:
    """Run a delay server until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves and is registered with the meta server:
    ``qmq ready role=delay group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    return run_server("delay", lambda: DelayServer(config))
