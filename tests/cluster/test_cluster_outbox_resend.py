"""Every send of an outbox row — the transactional producer's after commit, the watchdog's — is a
resend of a known message id: it goes only to the broker group that id picks, never fails over
to another, so the group that may have stored an earlier send's copy drops the repeat (found by
the fault campaign: a row whose after-commit send failed over while a master was cut off, then
stored again by the watchdog in the group its id picks; two copies, one delivered after the
other's ack). Real processes: two broker groups with a slave each; b1's slave stopped
(SIGSTOP): b1's master stores a send it cannot replicate, leaves it unanswered, and turns
read-only (it takes no sends until its slave is back), as a master cut off from its slave does."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
from clusterhelpers import LocalCluster, cluster_up, fast_config

from qmq.cli.admin import ask_every_broker
from qmq.client.message import Message
from qmq.client.routing import pick_group
from qmq.client.sync import Consumer, Producer
from qmq.protocol.codes import RequestCode
from qmq.tx import TransactionalProducer, Watchdog

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SUBJECT = "outbox.resend"
GROUPS = ("billing", "audit")
SEND_TIMEOUT_MS = 1_500  # below slave_timeout_ms (2 s): the first send is written before b1 turns read-only
ROUTE = ("b1", "b2")


def _picking_b1(producer: Producer) -> Message:
    for _ in range(1_000):
        m = producer.generate_message(SUBJECT)
        if pick_group(ROUTE, m.message_id) == "b1":
            return m
    raise AssertionError("no message id picked b1 in 1,000 tries")


def _stored(meta_server: str) -> dict[str, int]:
    """Messages of SUBJECT each broker group stores (its LAG answer for a group reading from the earliest)."""
    answers = asyncio.run(ask_every_broker(meta_server, RequestCode.LAG, {"subject": SUBJECT, "group": GROUPS[0]}))
    assert all(isinstance(a, dict) for a in answers.values()), answers
    return {name: int(a["messages"]) for name, a in answers.items() if isinstance(a, dict)}


def _rows(engine: sa.Engine, table: str) -> int:
    with engine.connect() as conn:
        return int(conn.execute(sa.text(f"SELECT count(*) FROM {table}")).scalar_one())


def _write_state(view: dict[str, Any], group: str) -> str:
    return str(next(g["write_state"] for g in view["groups"] if g["group"] == group))


@contextmanager
def _stopped(c: LocalCluster, name: str) -> Iterator[None]:
    pid = c.member(name).pid
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _deliveries(c: LocalCluster, want: set[str]) -> dict[str, Counter[str]]:
    """Every delivery of SUBJECT to each consumer group, pulled from the earliest and acknowledged,
    until every group had ``want`` and then 2 s more passed without anything new."""
    got: dict[str, Counter[str]] = {g: Counter() for g in GROUPS}
    with Consumer(app_code="outbox-tests", meta_server=c.meta_server) as consumer:
        pulls = {g: consumer.pull_consumer(SUBJECT, g, "earliest") for g in GROUPS}
        deadline = time.monotonic() + 60
        quiet_until: float | None = None
        while time.monotonic() < deadline:
            new = 0
            for g, pull in pulls.items():
                batch = pull.pull(100, 200)
                for m in batch:
                    got[g][m.message_id] += 1
                    new += 1
                batch.ack_all()
            if all(want <= set(got[g]) for g in GROUPS):
                if new:
                    quiet_until = time.monotonic() + 2
                elif quiet_until is not None and time.monotonic() >= quiet_until:
                    break
                quiet_until = quiet_until or time.monotonic() + 2
        consumer.flush_acks()
    return got


def test_an_outbox_row_is_stored_by_the_group_its_id_picks_only_and_delivered_once(tmp_path: Path) -> None:
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "0"]
    engine = sa.create_engine(f"sqlite:///{tmp_path / 'app.db'}")
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        c.wait_view(
            "both slaves replicating",
            lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 2,
        )
        # both broker groups serve the subject, each with the two consumer groups from the earliest
        for g in GROUPS:
            pull = {"subject": SUBJECT, "group": g, "consumer_id": "c", "session": "s", "max": 1, "start": "earliest"}
            asyncio.run(ask_every_broker(c.meta_server, RequestCode.PULL, pull))
        with Producer(app_code="shop", meta_server=c.meta_server, send_timeout_ms=SEND_TIMEOUT_MS) as producer:
            producer.send(_picking_b1(producer))  # the route is known, the connection to b1 open
            tx = TransactionalProducer(producer, engine, create_table=True)
            written, later = _picking_b1(producer), _picking_b1(producer)
            with _stopped(c, "b1-s1"):
                # 1. b1's master stores the row's message, cannot replicate it: no answer
                with engine.begin() as conn:
                    tx.send(conn, written)
                c.wait_view("b1 read-only", lambda v: _write_state(v, "b1") == "read-only")
                # 2. b1 takes no sends: a plain send goes to b2, an outbox row waits for b1
                with engine.begin() as conn:
                    tx.send(conn, later)
                tx.close()
                assert tx.messages_failed == 2, (tx.messages_sent, tx.messages_failed)
                assert _rows(engine, tx.table) == 2
                # 3. the watchdog, even with a plain producer, waits for b1 too
                watchdog = Watchdog(producer, engine, threshold_ms=0, send_wait_ms=3_000, backoff_ms=1)
                [report] = watchdog.run_once()
                assert (report.sent, report.failed) == (0, 2), report
                assert _stored(c.meta_server).get("b2", 0) == 0
            # b1's slave runs again, copies what its master stored, and b1 takes sends again
            c.wait_view("b1 writable", lambda v: _write_state(v, "b1") == "ok")
            stored = _stored(c.meta_server)
            assert stored["b2"] == 0
            assert stored["b1"] >= 2, stored  # the plain send's and the first row's, though never answered
            duplicates = producer.stats.duplicates
            deadline = time.monotonic() + 30
            while _rows(engine, tx.table) and time.monotonic() < deadline:
                time.sleep(0.05)  # the rows' back-off (1 ms, doubled per attempt) passes first
                watchdog.run_once()
            watchdog.close()
            assert _rows(engine, tx.table) == 0
            # b1 dropped the resends of what it had stored unanswered
            assert producer.stats.duplicates - duplicates == stored["b1"] - 1
        assert _stored(c.meta_server) == {"b1": 3, "b2": 0}
        got = _deliveries(c, {written.message_id, later.message_id})
        for g in GROUPS:
            assert got[g][written.message_id] == 1, got
            assert got[g][later.message_id] == 1, got
    engine.dispose()
