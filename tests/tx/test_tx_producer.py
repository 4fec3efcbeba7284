"""The transactional producer against a real `qmq standalone`: committed messages are consumed
once and their rows deleted, rolled-back ones never appear, the message sent is the one
encoded in the transaction, and a broker down at commit time neither blocks nor fails it."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from outbox_helpers import consume, outbox_rows, wait_until
from sqlalchemy.orm import Session

from qmq.client.message import Message
from qmq.client.sync import Producer
from qmq.common.clock import ManualClock
from qmq.common.errors import ConfigError
from qmq.testing import running_standalone
from qmq.tx import TransactionalProducer, Watchdog
from scratch_dbs import Database

pytestmark = pytest.mark.integration

_business = sa.MetaData()
orders = sa.Table("orders", _business, sa.Column("id", sa.Integer, primary_key=True), sa.Column("note", sa.Text))


class Rollback(Exception):
    """Raised inside a transaction block to roll it back."""


@pytest.fixture
def producer(meta_server: str) -> Iterator[Producer]:
    with Producer(app_code="tx-tests", meta_server=meta_server) as p:
        yield p


def _orders(engine: sa.Engine) -> list[int]:
    with engine.connect() as conn:
        return sorted(conn.scalars(sa.select(orders.c.id)))


@pytest.mark.smoke
def test_commit_sends_once_and_rollback_never(
    engine: sa.Engine, producer: Producer, meta_server: str, subject: str
) -> None:
    _business.create_all(engine)
    with TransactionalProducer(producer, engine, create_table=True) as tx:
        committed = [Message(subject, body=f"order {i}") for i in (1, 2)]
        with engine.begin() as conn:
            conn.execute(orders.insert(), [{"id": 1}, {"id": 2}])
            for m in committed:
                tx.send(conn, m)
        rolled_back = Message(subject, body="order 3")
        with contextlib.suppress(Rollback), engine.begin() as conn:
            conn.execute(orders.insert().values(id=3))
            tx.send(conn, rolled_back)
            raise Rollback
        after = Message(subject, body="order 4")
        with engine.begin() as conn:
            conn.execute(orders.insert().values(id=4))
            tx.send(conn, after)

        got = consume(meta_server, subject, 3)
        assert sorted(got) == sorted((m.message_id, m.body) for m in [*committed, after])
        assert _orders(engine) == [1, 2, 4]
        wait_until(lambda: outbox_rows(engine) == 0, 10, "deletion of the sent messages' rows")
    assert tx.messages_sent == 3
    assert tx.messages_failed == 0


def test_session_and_savepoint(pg: Database, producer: Producer, meta_server: str, subject: str) -> None:
    engine = pg.engine()
    _business.create_all(engine)
    try:
        with TransactionalProducer(producer, engine, create_table=True) as tx, Session(engine) as session:
            kept, dropped = Message(subject, body="kept"), Message(subject, body="savepoint rolled back")
            session.execute(orders.insert().values(id=1))
            tx.send(session, kept)
            with contextlib.suppress(Rollback), session.begin_nested():
                tx.send(session, dropped)
                raise Rollback
            session.commit()
            assert [i for i, _ in consume(meta_server, subject, 1)] == [kept.message_id]
            wait_until(lambda: outbox_rows(engine) == 0, 10, "deletion of the sent message's row")
    finally:
        engine.dispose()


def test_the_message_sent_is_the_one_encoded_in_the_transaction(
    pg: Database, producer: Producer, meta_server: str, subject: str
) -> None:
    engine = pg.engine()
    try:
        with TransactionalProducer(producer, engine, create_table=True, table="my_outbox") as tx:
            msg = Message(subject, message_id="order-42", body="as written", properties={"k": "v"}, tags=["t"])
            with engine.begin() as conn:
                tx.send(conn, msg)
                msg.body = "changed after send()"
            [(message_id, body)] = consume(meta_server, subject, 1)
            assert (message_id, body) == ("order-42", b"as written")
            wait_until(lambda: outbox_rows(engine, "my_outbox") == 0, 10, "deletion of the sent message's row")
    finally:
        engine.dispose()


def test_refusals_name_the_problem(pg: Database, producer: Producer, subject: str) -> None:
    engine, other = pg.engine(), pg.engine()
    try:
        with pytest.raises(ConfigError, match="table='bad name'"):
            TransactionalProducer(producer, engine, table="bad name")
        with TransactionalProducer(producer, engine, create_table=True) as tx:
            autocommit = engine.execution_options(isolation_level="AUTOCOMMIT")
            with autocommit.connect() as conn, pytest.raises(ConfigError, match="AUTOCOMMIT"):
                tx.send(conn, Message(subject))
            with other.begin() as conn, pytest.raises(ConfigError, match="not to the engine"):
                tx.send(conn, Message(subject))
        assert outbox_rows(engine) == 0
    finally:
        engine.dispose()
        other.dispose()


@pytest.mark.slow
def test_broker_down_at_commit(pg: Database, tmp_path: Path, subject: str) -> None:
    """The commit neither waits nor fails; the row stays; once a broker is back the watchdog sends it."""
    engine = pg.engine()
    data_dir = tmp_path / "qmq-data"
    try:
        with running_standalone(data_dir) as first:
            producer = Producer(app_code="tx-tests", meta_server=first.meta_server, send_timeout_ms=300)
            tx = TransactionalProducer(producer, engine, create_table=True)
            first.stop()
            msg = Message(subject, body="sent while the broker was down")
            started = time.monotonic()
            with engine.begin() as conn:
                tx.send(conn, msg)
            commit_s = time.monotonic() - started
            assert commit_s < 0.5, f"the commit took {commit_s:.3f} s with the broker down"
            # The producer gives up after send_timeout_ms; the failure is counted on the row.
            wait_until(lambda: tx.finisher_stats.failures_recorded == 1, 10, "the failed send being recorded")
            tx.close()
            producer.close()
        assert outbox_rows(engine) == 1

        with running_standalone(data_dir) as second, Producer(app_code="tx-tests", meta_server=second.meta_server) as p:
            clock = ManualClock(start_ms=int(time.time() * 1000))
            dog = Watchdog(p, engine, threshold_ms=60_000, clock=clock)
            assert dog.run_once()[0].sent == 0, "younger than the threshold: left alone"
            clock.advance(61)
            [report] = dog.run_once()
            assert (report.sent, report.failed, report.error) == (1, 0, None)
            dog.close()
            assert consume(second.meta_server, subject, 1) == [(msg.message_id, msg.body)]
        assert outbox_rows(engine) == 0
    finally:
        engine.dispose()
