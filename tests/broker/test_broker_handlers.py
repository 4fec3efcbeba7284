"""The broker's handlers alone: built against a small context of a store, metrics and the
broker's state (no server, no socket), answering frames through a recording responder."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import msgpack
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
from qmq.protocol.answers import PAGE_BYTES_MAX
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
    draining: bool = False
    replicator: Replicator | None = None
    tracing: None = None
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


def test_a_draining_master_refuses_sends_so_the_sdk_goes_to_another_group_and_still_serves_pulls(
    context: Context,
) -> None:
    conn = RecordingResponder()
    handlers = Handlers(context)
    handlers.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 11, {}, message("s.a", "id-3")))
    context.draining = True
    handlers.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 12, {}, message("s.a", "id-4")))
    pull = {"subject": "s.a", "group": "g", "consumer_id": "c", "session": "x", "max": 10}
    handlers.dispatch(conn, Frame(RequestCode.PULL, 13, pull))
    stored, refused, pulled = conn.answers
    assert stored[3] == Status.OK
    assert (refused[0], refused[1], refused[3]) == (RequestCode.SEND_MESSAGES, 12, Status.NOT_MASTER)
    assert "broker group g-7 is draining" in refused[2]["error"]
    assert context.store.subjects["s.a"].visible_seq == 1  # id-4 was not stored
    assert (pulled[1], pulled[3]) == (13, Status.OK)  # consumers keep pulling what it holds


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


# -- listings: in the body, paged by count and by bytes -----------------------------------


def follow(handlers: Handlers, code: RequestCode, header: dict[str, Any]) -> list[dict[str, Any]]:
    """Every page of a listing, each checked to fit its byte budget (an item over it only alone)."""
    pages: list[dict[str, Any]] = []
    after: Any = None
    for request_id in range(1, 100):
        conn = RecordingResponder()
        handlers.dispatch(conn, Frame(code, request_id, header if after is None else {**header, "after": after}))
        [(_code, _id, doc, status)] = conn.answers
        assert status == Status.OK, doc
        assert doc is not None
        pages.append(doc)
        listed = next(v for k, v in doc.items() if k in ("subjects", "consumers", "letters"))
        assert len(listed) == 1 or len(msgpack.packb(doc)) <= PAGE_BYTES_MAX + 1024  # and its figures
        after = doc.get("next")
        if after is None:
            return pages
    raise AssertionError("the listing never ended")


def test_subjects_are_paged_and_a_subjects_groups_run_on_into_the_next_page(context: Context) -> None:
    store = context.store
    names = [f"s.{i:03d}." + "n" * 90 for i in range(40)]
    groups = [f"g{i:04d}." + "x" * 90 for i in range(3000)]  # 3,000 x ~100 bytes: past one page
    for name in names:
        store.group(name, "g", "earliest")
    for group in groups:
        store.group(names[7], group, "earliest")
    pages = follow(Handlers(context), RequestCode.SUBJECTS, {})
    assert len(pages) >= 2
    items = [item for page in pages for item in page["subjects"]]
    listed = [i["subject"] for i in items]
    assert sorted(set(listed)) == names
    assert listed.count(names[7]) == len(pages)  # its groups ran over every page boundary
    seventh = [g for i in items if i["subject"] == names[7] for g in i["groups"]]
    assert seventh == sorted(["g", *groups])
    by_count = follow(Handlers(context), RequestCode.SUBJECTS, {"limit": 3})
    assert [i["subject"] for p in by_count[:2] for i in p["subjects"]] == names[:6]


def test_lag_pages_consumers_by_id_and_limit_0_gives_the_figures_alone(context: Context) -> None:
    gp = context.store.group("s.lag", "g", "earliest")
    ids = [f"consumer-{i:05d}-" + "c" * 150 for i in range(2500)]
    for consumer_id in reversed(ids):
        gp.consumer(consumer_id)
    pages = follow(Handlers(context), RequestCode.LAG, {"subject": "s.lag", "group": "g"})
    assert len(pages) >= 2
    assert [c["consumer_id"] for p in pages for c in p["consumers"]] == ids
    assert {p["consumers_total"] for p in pages} == {2500}
    [figures] = follow(Handlers(context), RequestCode.LAG, {"subject": "s.lag", "group": "g", "limit": 0})
    assert figures["consumers"] == []
    assert "next" not in figures
    assert (figures["messages"], figures["backlog"], figures["unacked"]) == (0, 0, 0)


def test_lag_says_when_each_consumer_was_seen_and_which_are_offline(context: Context) -> None:
    gp = context.store.group("s.seen", "g", "earliest")
    now_ms = context.clock.now_ms()
    gp.consumer("fresh").last_seen_ms = now_ms - context.config.consumer_offline_ms + 1
    gp.consumer("silent").last_seen_ms = now_ms - context.config.consumer_offline_ms
    [page] = follow(Handlers(context), RequestCode.LAG, {"subject": "s.seen", "group": "g"})
    assert {c["consumer_id"]: (c["last_seen_ms"], c["offline"]) for c in page["consumers"]} == {
        "fresh": (now_ms - context.config.consumer_offline_ms + 1, False),
        "silent": (now_ms - context.config.consumer_offline_ms, True),
    }
    assert (page["time_ms"], page["consumers_offline"]) == (now_ms, 1)
    assert page["consumer_offline_ms"] == context.config.consumer_offline_ms


def test_lag_tells_an_unknown_subject_from_a_group_that_never_pulled(context: Context) -> None:
    context.store.group("s.known", "g", "earliest")
    for subject, group, error in [
        ("s.unknown", "g", "subject 's.unknown' is unknown here"),
        ("s.known", "other", "consumer group 'other' has never pulled 's.known'"),
    ]:
        conn = RecordingResponder()
        Handlers(context).dispatch(conn, Frame(RequestCode.LAG, 1, {"subject": subject, "group": group}))
        [(_code, _id, answer, status)] = conn.answers
        assert status == Status.BAD_REQUEST
        assert answer is not None
        assert error in answer["error"]


def test_dead_letters_are_paged_by_limit_and_by_bytes(context: Context) -> None:
    dead = "%DEAD_RETRY%s.d%g"
    error = "处理失败" * 1000  # 12 KB of UTF-8 a letter
    body = b"".join(message(dead, f"d{i}", props={"qmq.error": error}) for i in range(60))
    conn = RecordingResponder()
    handlers = Handlers(context)
    handlers.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 1, {}, body))
    assert conn.answers[0][2] == {"errors": [], "duplicates": 0}
    pages = follow(handlers, RequestCode.DEAD_LETTERS, {"subject": "s.d", "group": "g", "limit": 1000})
    assert len(pages) == 3  # 720 KB in pages of 256 KiB
    assert [x["message_id"] for p in pages for x in p["letters"]] == [f"d{i}" for i in range(60)]
    assert {p["total"] for p in pages} == {60}
    by_limit = follow(handlers, RequestCode.DEAD_LETTERS, {"subject": "s.d", "group": "g", "limit": 7})
    assert [len(p["letters"]) for p in by_limit[:2]] == [7, 7]


def test_a_cursor_that_is_not_one_is_refused(context: Context) -> None:
    conn = RecordingResponder()
    Handlers(context).dispatch(conn, Frame(RequestCode.SUBJECTS, 1, {"after": "s.a"}))
    [(_code, _id, header, status)] = conn.answers
    assert status == Status.BAD_REQUEST
    assert header is not None
    assert "pass back the 'next' of the last page" in header["error"]


async def test_a_read_that_fails_while_slaves_wait_answers_them_busy(context: Context) -> None:
    # Found by the fault campaign (chaos/, failing disk): the read error escaped the wake-up of
    # waiting slaves, which dropped every waiting REPLICATE unanswered; the group went read-only.
    import asyncio

    from qmq.store import fileio

    slaves = [RecordingResponder(), RecordingResponder()]
    ask = {"from": 0, "action_from": 0, "max_bytes": 65536, "timeout_ms": 30_000}
    for i, conn in enumerate(slaves):
        context.source.request(conn, RequestCode.REPLICATE, i, dict(ask), f"slave:{i}")
    assert [conn.answers for conn in slaves] == [[], []]  # nothing to copy yet: they wait
    Handlers(context).dispatch(RecordingResponder(), Frame(RequestCode.SEND_MESSAGES, 8, {}, message("s.a", "id-1")))
    try:
        with fileio.faults({"op": "read", "path": "log/*.log", "errno": "EIO"}):
            context.source.grew()
            await asyncio.sleep(0)  # the wake-up runs on the next loop turn
    finally:
        fileio.install(None)
    for i, conn in enumerate(slaves):
        [(code, request_id, header, status)] = conn.answers
        assert (code, request_id, status) == (RequestCode.REPLICATE, i, Status.BUSY)
        assert "reading the log to replicate failed" in header["error"]
    again = RecordingResponder()
    context.source.request(again, RequestCode.REPLICATE, 9, dict(ask), "slave:0")
    [(_code, _rid, header, status)] = again.answers
    assert status == Status.OK
    assert header["count"] > 0


def test_only_slaves_the_meta_server_named_count_toward_the_write_state(context: Context) -> None:
    # Found by the fault campaign (chaos/, hostile clients): any REPLICATE counted as a slave.
    source = context.source
    ask = {"from": 0, "action_from": 0, "max_bytes": 65536, "timeout_ms": 0}
    source.request(RecordingResponder(), RequestCode.REPLICATE, 1, dict(ask), "x:1")
    assert source.slaves == {}  # a client that only claims to be a slave
    assert source.write_state() == "alone"
    source.request(RecordingResponder(), RequestCode.REPLICATE, 2, dict(ask), "s:1")  # before its master heard of it
    source.slaves_reported = 1
    source.name_slaves(["s:1"])
    assert set(source.slaves) == {"s:1"}  # counts from its last request on
    assert source.write_state() == "replicated"
    source.name_slaves([])  # the meta server no longer hears from it: it still counts (read-only once stale)
    assert set(source.slaves) == {"s:1"}
    for i in range(100):  # slaves restarted on new ports: the least recently named go first
        source.name_slaves([f"s:{i + 2}"])
    assert len(source.named or {}) == 64
    assert "s:1" not in source.slaves


async def test_requesters_the_meta_server_never_named_take_a_quarter_of_the_long_polls_at_most(
    context: Context,
) -> None:
    source = context.source
    source.name_slaves(["s:1"])
    ask = {"from": 0, "action_from": 0, "max_bytes": 65536, "timeout_ms": 30_000}
    claims = [RecordingResponder() for _ in range(40)]
    for i, conn in enumerate(claims):
        source.request(conn, RequestCode.REPLICATE, i, dict(ask), f"x:{i}")
    waiting = [conn for conn in claims if not conn.answers]
    assert len(waiting) == 16  # the rest were answered at once (nothing to copy): they may ask again
    slave = RecordingResponder()
    source.request(slave, RequestCode.REPLICATE, 99, dict(ask), "s:1")
    assert slave.answers == []  # the group's slave still waits for the log to grow
    source.fail_all("stopping")


def test_a_write_that_comes_to_wait_after_the_master_was_demoted_is_refused_until_it_is_master_again(
    context: Context,
) -> None:
    # Found by tests/cluster/test_cluster_replace.py (a flake under load): sends whose fsync ended
    # after a promotion elsewhere waited for a slave that no longer copied from this broker, and
    # were answered by nobody until the producer's send timeout.
    source = context.source
    source.slaves_reported = 1
    source.name_slaves(["s:1"])
    ask = {"from": 0, "action_from": 0, "max_bytes": 65536, "timeout_ms": 0}
    source.request(RecordingResponder(), RequestCode.REPLICATE, 1, dict(ask), "s:1")
    assert source.write_state() == "replicated"
    answers: list[str | None] = []
    source.after_log_replicated(10**9, answers.append)  # waits for the slave
    assert answers == []
    source.fail_all("broker b is no longer master of group g; retry")
    assert answers == ["broker b is no longer master of group g; retry"]
    source.after_log_replicated(10**9, answers.append)  # its fsync ended after the demotion
    source.after_actions_replicated(10**9, answers.append)
    source.after_log_replicated(0, answers.append)  # even what would count as replicated
    assert answers[1:] == ["broker b is no longer master of group g; retry"] * 3
    source.reset(100, 100)  # master again, in a newer epoch
    source.after_log_replicated(50, answers.append)
    assert answers[4:] == [None]
