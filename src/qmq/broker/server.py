"""The broker process: its state (store, group commit, parked pulls, replication, its role and
epoch in the group), the timers that checkpoint, apply retention and move silent consumers'
messages to retry, the changes of role the meta server orders, and its shutdown order. The
listening shell, dispatch, registration and the process runner come from ``qmq.serving``;
what each request does is in ``qmq.broker.handlers``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging

from qmq.auth.http import basic_authorization
from qmq.broker.backlog import unconsumed
from qmq.broker.controls import ControlsPoller, Paused, filters_of
from qmq.broker.handlers import Handlers
from qmq.broker.metrics import BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.broker.release import Release
from qmq.broker.replication import ReplicationSource, Replicator
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import BrokerConfig
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.common.naming import RETRY_PREFIX
from qmq.serving.connection import FrameConnection
from qmq.serving.group_commit import GroupCommit
from qmq.serving.group_role import GroupMember
from qmq.serving.runner import StartupError, run_server
from qmq.serving.server import FrameServer
from qmq.serving.tracing import server_tracing
from qmq.store.broker_store import BrokerStore
from qmq.store.redelivery import expire_silent_consumers
from qmq.store.replica import rewind
from qmq.store.retention import run_retention
from qmq.store.segments import FlushTicket

log = logging.getLogger(__name__)


class BrokerServer(FrameServer, GroupMember):
    kind = "broker"
    title = "broker"
    config: BrokerConfig
    store: BrokerStore
    metrics: BrokerMetrics
    source: ReplicationSource
    replicator: Replicator | None

    def __init__(self, config: BrokerConfig, clock: Clock = SYSTEM_CLOCK, limits: Limits | None = None) -> None:
        limits = limits or dataclasses.replace(DEFAULT_LIMITS, message_bytes_max=config.message_bytes_max)
        self.store = BrokerStore(config, clock, limits)
        self.metrics = BrokerMetrics(self.store)
        # A checkpoint fsyncs every consume log written since the last one: on the group commit's
        # thread, sends waiting for their fsync would wait behind it.
        super().__init__(config, limits, self.metrics.connections.set, "qmq-checkpoint")
        self.clock = clock
        self.tracing = server_tracing(
            config.trace_spans, config.trace_sample_ratio, config.trace_endpoint, "broker", config.group
        )
        self.parked = ParkedPulls(self.store, self.metrics.waiting_pulls.set)
        # One group commit for the message log and the action log: a send is answered after the
        # fsync covering it, and so is an ack (under flush = "sync"; under "periodic" both are
        # fsynced every flush_interval_ms), so a power loss never delivers again what a group was
        # told it had acknowledged. Acks, pulls and sends share each fsync.
        self.flusher = GroupCommit(
            "the message and action logs",
            self._begin_flush,
            self._flushed,
            self.metrics.flush_seconds.observe,
            self._disk_failed,
            on_loop_max_s=config.fsync_on_loop_ms / 1000 if config.flush == "sync" else 0.0,
        )
        self.action_flusher = self.flusher.actions()
        # told by the meta server's heartbeat answer (`qmq admin drain`): sends are refused
        self.draining = False
        self._start_in_role(self.store.dir, config.role, "broker", config.group)
        self.source = ReplicationSource(lambda: self.store, config)
        self.store.on_grow = self.source.grew
        self.replicator: Replicator | None = None
        self.release = Release(self)
        self.handlers = Handlers(self)
        self.dispatch = self.handlers.dispatch
        self._controls: ControlsPoller | None = None

    def forget(self, conn: FrameConnection) -> None:
        super().forget(conn)
        self.parked.drop_owner(conn)
        self.source.forget(conn)

    # -- lifecycle ---------------------------------------------------------------------

    async def start(self) -> None:
        """Recover the store, listen, serve metrics, and (with a meta server) register."""
        report = self.store.open()
        log.info("store recovered: %s", report)
        self.flusher.flushed_offset = self.store.mlog.end
        self.checkpointing = asyncio.Lock()
        cfg = self.config
        await self.listen()
        if cfg.flush == "periodic" or self.role == "slave":
            self.flusher.start_periodic(cfg.flush_interval_ms)
        self.release.schedule()  # what was held when the broker stopped is due by now, or soon
        self.periodic.every(cfg.checkpoint_interval_ms, self.checkpoint)
        self.periodic.every(cfg.retention_check_interval_ms, self._retention)
        silent_check_ms = max(10, min(cfg.consumer_offline_ms // 4, 5_000))
        self.periodic.every(silent_check_ms, self._expire_silent)
        slave_check_ms = max(10, min(cfg.slave_timeout_ms // 4, 1_000))
        self.periodic.every(slave_check_ms, self._check_slaves)
        if cfg.meta_server:
            self.register(self._heartbeat, on_answer=self._on_answer)
            secret = self.secret()
            authorization = basic_authorization(cfg.app_code, secret) if secret else None
            self._controls = ControlsPoller(
                cfg.meta_server, self._apply_paused, self._apply_filters, authorization, self.tls_out
            )
            self._controls.start()
        elif self.role == "slave":
            raise StartupError("a slave needs --meta-server: the meta server names its master")

    def _apply_paused(self, paused: Paused) -> None:
        """The meta server's paused groups (qmq.broker.controls); the resumed ones' long polls are tried now."""
        before, self.parked.paused = self.parked.paused, paused
        resumed = {subject for subject, _group in before - paused}
        if resumed:
            self.parked.notify(resumed)

    def _apply_filters(self, rows: object) -> None:
        """The meta server's group filters (qmq.broker.controls), compiled when new or changed."""
        self.parked.filters = filters_of(rows, self.parked.filters)

    # -- roles in the group (docs/cluster.md) --------------------------------------------

    def _heartbeat(self) -> dict[str, object]:
        payload: dict[str, object] = self.registration_payload()
        payload.update(
            role_in_group=self.role,
            epoch=self.epoch,
            log_end=self.store.mlog.end,
            action_end=self.store.alog.end,
        )
        if self.role == "master":
            payload["write_state"] = self.write_state()
            payload["unconsumed"] = {**unconsumed(self.store), "draining": self.draining}
        elif self.replicator is not None:
            payload["replicated_ms"] = self.replicator.last_ms
        return payload

    def _on_answer(self, answer: dict[str, object]) -> None:
        if answer.get("role_in_group") not in ("master", "slave") or self.stopping:
            return  # a meta server that does not manage roles: stay as started
        # draining (docs/cluster.md, "Operations"): no new sends; pulls and acks go on
        self.draining = answer.get("draining") is True
        self._take_orders(answer)

    async def _promote(self, epoch: int) -> None:
        log.warning("promoted to master of group %s in epoch %d", self.config.group, epoch)
        if self.replicator is not None:
            await self.replicator.stop()
            self.replicator = None
        self._set_epoch(epoch, "master")
        self.store.new_stretch()
        self.source.reset(self.store.mlog.end, self.store.alog.end)
        self.flusher.flushed_offset = self.store.mlog.end
        # A slave never hears from consumers: their silence is counted from the promotion, as from a
        # restart (store/recovery.py), not from the epoch, or every consumer's unacknowledged
        # messages (a gateway's held ones too) would go to retry at the first offline check.
        now_ms = self.clock.now_ms()
        for gp in self.store.progress.groups.values():
            for cp in gp.consumers.values():
                cp.last_seen_ms = max(cp.last_seen_ms, now_ms)
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
                assert self.checkpointing is not None
                async with self.checkpointing:
                    rewind(self.store, message_offset, action_offset)
        self._set_epoch(epoch, "slave")
        self.replicator = Replicator(
            lambda: self.store, master, epoch, self.address, lambda _subjects: None, self.credentials(), self.tls_out
        )
        self.replicator.start()
        if self._registration is not None:
            self._registration.beat_now()

    def _begin_flush(self) -> FlushTicket:
        # long polls take what was sent since the last flush, their records then covered by this one
        self.parked.take_flush_wakes()
        return self.store.begin_flush()

    def _flushed(self, ticket: FlushTicket) -> None:
        moved = self.store.complete_flush(ticket)
        if moved:
            self.parked.notify(moved)

    async def checkpoint(self) -> None:
        assert self.checkpointing is not None
        async with self.checkpointing:
            store = self.store
            state = store.checkpoint_state()
            # the logs up to the checkpoint's offsets, through the group commit (one thread fsyncs
            # them, so a segment's directory entry is never left to a flush not yet done)
            await self.flusher.flush_once()
            ticket = store.begin_checkpoint_flush()
            await asyncio.get_running_loop().run_in_executor(
                self.checkpoint_executor, store.write_checkpoint, ticket, state
            )
            store.after_checkpoint(state)

    async def _retention(self) -> None:
        run_retention(self.store)

    async def _expire_silent(self) -> None:
        if self.role != "master":
            # a slave's copy changes only by what its master sends: it moves nothing to retry and
            # forgets no consumer on its own (its master's logs say when)
            return
        now_ms = self.clock.now_ms()
        if expire_silent_consumers(self.store, now_ms, self.config.consumer_offline_ms):
            self.after_internal_append({s for s in self.store.subjects if s.startswith(RETRY_PREFIX)})
        forgotten = self.store.forget_gone_consumers(now_ms, self.config.consumer_forget_ms)
        if forgotten:
            log.info("forgot %d consumer(s) gone with nothing unacknowledged", forgotten)

    def after_internal_append(self, subjects: set[str]) -> None:
        """The broker stored messages itself (retries): make them visible and wake their long polls."""
        if self.store.sync_policy:
            self.flusher.after_write(self.store.mlog.end, lambda _error: None)
        else:
            self.parked.notify(subjects)

    def write_state(self) -> str:
        """What a send to this master meets: "ok", "failed" (the store stopped taking writes until a
        restart), "disk-full" (clears by itself once space is freed), "read-only" or "degraded"
        (the slave is gone: docs/cluster.md)."""
        if self.store.failed is not None or self.flusher.failed is not None:
            return "failed"
        if self.handlers.free_space.low() is not None:
            return "disk-full"
        state = self.source.write_state()
        return {"alone": "ok", "replicated": "ok"}.get(state, state)

    def health(self) -> dict[str, object]:
        failed = self.store.failed
        if failed is None and self.flusher.failed is not None:
            failed = f"an fsync failed: {self.flusher.failed}"
        body: dict[str, object] = {
            "ok": not self.stopping and failed is None,
            "group": self.config.group,
            "role_in_group": self.role,
            "epoch": self.epoch,
        }
        if self.role == "master":
            body["write_state"] = self.write_state()
        if failed is not None:
            body["error"] = f"the store stopped taking writes ({failed}); restart the broker"
        elif (low := self.handlers.free_space.low()) is not None:
            body["error"] = low
        return body

    def _disk_failed(self, exc: BaseException) -> None:
        log.critical("the broker's disk failed (%s); it no longer takes sends", exc)

    async def stop(self) -> None:
        """Stop accepting, answer parked pulls, finish in-flight writes, flush, checkpoint, close."""
        if self.stopping:
            return
        self.stopping = True
        self.release.cancel()
        if self._controls is not None:
            await self._controls.stop()
        await self.stop_listening()
        await self._end_transition()
        if self.replicator is not None:
            await self.replicator.stop()
        self.source.fail_all(f"broker {self.address} is shutting down; retry")
        self.parked.answer_all_empty()
        await self.drain_writes(self.config.shutdown_grace_ms / 1000)  # sends and acks: one group commit
        await self.periodic.stop()
        await self.final_checkpoint()
        await self.close_connections()
        await self.close_store()
        if self.tracing is not None:
            await asyncio.to_thread(self.tracing.shutdown)


def run_broker(config: BrokerConfig) -> int:
    """Run a broker until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves (and, with a meta server, is registered):
    ``qmq ready role=broker group=G address=HOST:PORT http=http://HOST:PORT pid=N``.
    """
    return run_server("broker", lambda: BrokerServer(config))
