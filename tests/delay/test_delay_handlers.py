"""The delay server's handlers alone: built against a small context of a store, metrics and
the server's hooks (no server, no producer, no socket), answering frames through a recording
responder."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from delayhelpers import T0_MS, config, encoded, manual_clock

from qmq.common.clock import ManualClock
from qmq.common.config import DelayConfig
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.delay.dispatcher import Dispatcher
from qmq.delay.handlers import STATS_BUCKETS_MAX, Handlers
from qmq.delay.metrics import DelayMetrics
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.delay.timer import Rows
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.group_commit import GroupCommit
from qmq.serving.replication import ReplicationSource, Replicator
from qmq.serving.replies import Reply
from qmq.store.segments import FlushTicket
from recording import RecordingResponder


@dataclass
class Context:
    """A delay server as its handlers see it (qmq.delay.handlers.DelayContext)."""

    config: DelayConfig
    clock: ManualClock
    store: DelayStore
    metrics: DelayMetrics
    flusher: GroupCommit
    scheduler: Scheduler
    limits: Limits = DEFAULT_LIMITS
    dispatcher: Dispatcher | None = None
    stopping: bool = False
    disk_error: BaseException | None = None
    unflushed: deque[tuple[int, Rows]] = field(default_factory=deque)
    arrivals: list[Rows] = field(default_factory=list)
    prepared: list[list[str]] = field(default_factory=list)
    address: str = "127.0.0.1:1"
    role: str = "master"
    epoch: int = 1
    replicator: Replicator | None = None
    tracing: None = None

    @property
    def source(self) -> ReplicationSource:
        return ReplicationSource(lambda _h: ({}, [], False), self.config, lambda: (0, 0))

    def after_replicated(self, end: int, reply: Reply, replicated: Reply | None = None) -> None:
        done = replicated or reply  # no slave here: durable is replicated
        if self.store.sync_policy:
            self.flusher.after_write(end, lambda error: reply(error) if error is not None else done(None))
        else:
            done(None)

    def sync_in_background(self) -> None:
        pass

    def prepare_routes(self, subjects: list[str]) -> None:
        self.prepared.append(list(subjects))

    def poke_dispatcher(self) -> None:
        pass

    def arrived(self, rows: Rows) -> None:
        self.arrivals.append(rows)

    def release_durable(self) -> None:
        pass


@pytest.fixture
def context(tmp_path: Path) -> Iterator[Context]:
    cfg = config(tmp_path / "delay", group="delay-9")
    clock = manual_clock()
    store = DelayStore(cfg, clock)
    store.open()
    flusher = GroupCommit(
        "the write-ahead log",
        lambda: FlushTicket(store.wal.segments.sync_fds(), store.wal.end),
        lambda _t: None,
        lambda _s: None,
        lambda _e: None,
    )
    yield Context(cfg, clock, store, DelayMetrics(), flusher, Scheduler(store, cfg.preload_ms))
    flusher.executor.shutdown()
    store.close()


def test_ping_answers_the_role_group_and_time(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.PING, 1))
    assert conn.answers == [(RequestCode.PING, 1, {"role": "delay", "group": "delay-9", "time_ms": T0_MS}, Status.OK)]
    assert context.metrics.registry.get_sample_value("qmq_delay_requests_total", {"command": "PING"}) == 1


def test_a_broker_command_is_refused_naming_what_a_delay_server_takes(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.PULL, 2))
    assert conn.answers == [
        (
            RequestCode.PULL,
            2,
            {
                "error": "command code 3 is not served by a delay server (group delay-9); it takes PING, "
                "SEND_MESSAGES, DELAY_STATS, CANCEL_DELAY and DELAY_LIST: pull from a broker"
            },
            Status.UNKNOWN_COMMAND,
        )
    ]


def test_a_bad_request_names_the_field(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.DELAY_STATS, 3, {"buckets_max": -1}))
    text = f"'buckets_max' = -1 must be a whole number from 0 to {STATS_BUCKETS_MAX}"
    assert conn.answers == [(RequestCode.DELAY_STATS, 3, {"error": text}, Status.BAD_REQUEST)]


def test_a_send_is_stored_answered_and_handed_to_the_timer(context: Context) -> None:
    conn = RecordingResponder()
    body = encoded("s.late", "id-1", T0_MS + 30_000) + encoded("s.late", "id-2", T0_MS + 40_000)
    Handlers(context).dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 4, {}, body))
    assert conn.answers == [(RequestCode.SEND_MESSAGES, 4, {"errors": []}, Status.OK)]
    assert len(context.arrivals) == 1  # rows of loaded buckets only: none is loaded yet
    assert context.prepared == [["s.late"]]  # routes of a new subject are looked up long before due
    assert context.metrics.registry.get_sample_value("qmq_delay_messages_in_total") == 2


def test_a_stopping_server_refuses_sends(context: Context) -> None:
    context.stopping = True
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 5, {}, encoded("s.a", "id-3", T0_MS + 1)))
    (_code, _id, header, status) = conn.answers[0]
    assert status == Status.SHUTTING_DOWN
    assert header == {"error": "the delay server is shutting down; send to another delay group or retry"}
    assert context.arrivals == []
