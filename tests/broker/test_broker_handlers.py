"""The broker's handlers alone: built against a small context of a store, metrics and the
broker's state (no server, no socket), answering frames through a recording responder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NoReturn

import pytest
from rawclient import message

from qmq.broker.handlers import Handlers
from qmq.broker.metrics import BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.broker.release import Release
from qmq.broker.replication import ReplicationSource, Replicator
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.group_commit import GroupCommit
from qmq.store.broker_store import BrokerStore
from recording import RecordingResponder


@dataclass
class Context:
    """A broker as its handlers see it (qmq.broker.handlers.BrokerContext)."""

    config: BrokerConfig
    clock: ManualClock
    store: BrokerStore
    metrics: BrokerMetrics
    flusher: GroupCommit
    parked: ParkedPulls
    source: ReplicationSource
    limits: Limits = DEFAULT_LIMITS
    role: str = "master"
    epoch: int = 3
    address: str = "127.0.0.1:9999"
    stopping: bool = False
    replicator: Replicator | None = None
    release: Release = field(init=False)


@pytest.fixture
def context(tmp_path: Path) -> Iterator[Context]:
    config = BrokerConfig(data_dir=tmp_path / "broker", group="g-7", flush="periodic")
    clock = ManualClock()
    store = BrokerStore(config, clock)
    store.open()
    metrics = BrokerMetrics(store)
    flusher = GroupCommit("the message log", store.begin_flush, lambda _t: None, lambda _s: None, lambda _e: None)
    ctx = Context(
        config,
        clock,
        store,
        metrics,
        flusher,
        ParkedPulls(store, lambda _n: None),
        ReplicationSource(lambda: store, config),
    )
    ctx.release = Release(ctx)
    yield ctx
    flusher.executor.shutdown()
    store.close()


def requests_counted(metrics: BrokerMetrics, command: str) -> float | None:
    return metrics.registry.get_sample_value("qmq_requests_total", {"command": command})


def test_ping_answers_the_role_group_and_time(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.PING, 5))
    assert conn.answers == [
        (RequestCode.PING, 5, {"role": "broker", "group": "g-7", "time_ms": context.clock.now_ms()}, Status.OK)
    ]
    assert requests_counted(context.metrics, "PING") == 1


def test_an_unknown_code_is_refused_and_not_counted(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(99, 6))
    assert conn.answers == [(99, 6, {"error": "unknown command code 99"}, Status.UNKNOWN_COMMAND)]
    assert "qmq_requests_total{" not in context.metrics.render().decode()


def test_a_bad_request_names_the_field(context: Context) -> None:
    conn = RecordingResponder()
    header = {"subject": "s.a", "group": "g", "consumer_id": "c", "session": "x"}
    Handlers(context).dispatch(conn, Frame(RequestCode.PULL, 7, header))
    assert conn.answers == [(RequestCode.PULL, 7, {"error": "request header lacks 'max'"}, Status.BAD_REQUEST)]


def test_a_send_is_stored_and_answered(context: Context) -> None:
    conn = RecordingResponder()
    body = message("s.a", "id-1", b"hello")
    Handlers(context).dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 8, {}, body))
    assert conn.answers == [(RequestCode.SEND_MESSAGES, 8, {"errors": [], "duplicates": 0}, Status.OK)]
    assert context.store.subjects["s.a"].visible_seq == 1


def test_a_slave_refuses_what_only_a_master_does_naming_its_group(context: Context) -> None:
    context.role = "slave"
    conn = RecordingResponder()
    handlers = Handlers(context)
    handlers.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 9, {}, message("s.a", "id-2")))
    handlers.dispatch(conn, Frame(RequestCode.PING, 10))
    (code, request_id, header, status), ping = conn.answers
    assert (code, request_id, status) == (RequestCode.SEND_MESSAGES, 9, Status.NOT_MASTER)
    assert header == {
        "error": "broker 127.0.0.1:9999 is a slave of group g-7 (epoch 3); its master is unknown yet: "
        "clients find masters through the meta server"
    }
    assert ping[3] == Status.OK  # what a slave may serve, it serves
    assert "s.a" not in context.store.subjects


def test_a_failing_store_costs_one_request(context: Context, monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(*_args: object) -> NoReturn:
        raise KeyError("lost")

    monkeypatch.setattr(context.store, "read_range", broken)
    conn = RecordingResponder()
    handlers = Handlers(context)
    handlers.dispatch(conn, Frame(RequestCode.READ, 11, {"subject": "s.a", "from": 0, "max": 10}))
    handlers.dispatch(conn, Frame(RequestCode.PING, 12))
    assert conn.answers[0] == (
        RequestCode.READ,
        11,
        {"error": "internal error: KeyError: 'lost'"},
        Status.INTERNAL_ERROR,
    )
    assert conn.answers[1][3] == Status.OK
