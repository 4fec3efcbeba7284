"""The watchdog against a real `qmq standalone`: old rows are resent and deleted, young ones left
alone, one watchdog at a time holds the lease, two racing watchdogs never send a row twice,
and a row that keeps failing is blocked, listed and unblocked."""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from collections.abc import Iterator

import pytest
import sqlalchemy as sa
from outbox_helpers import consume, leave_rows, outbox_rows

from qmq.client.message import Message
from qmq.client.sync import Producer
from qmq.common.clock import ManualClock
from qmq.tx import Watchdog, create_outbox_tables, list_blocked, unblock
from qmq.tx.schema import outbox_table
from scratch_dbs import Database

pytestmark = pytest.mark.integration


class CountingProducer:
    """The real producer, counting what each watchdog hands it per message id."""

    def __init__(self, producer: Producer) -> None:
        self._producer = producer
        self._lock = threading.Lock()
        self.sends: collections.Counter[str] = collections.Counter()

    def send_async(self, message: Message, *, resend: bool = False) -> concurrent.futures.Future[None]:
        with self._lock:
            self.sends[message.message_id] += 1
        return self._producer.send_async(message, resend=resend)


@pytest.fixture
def producer(meta_server: str) -> Iterator[Producer]:
    with Producer(app_code="tx-watchdog-tests", meta_server=meta_server) as p:
        yield p


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock(start_ms=int(time.time() * 1000))


def test_resends_old_rows_only(
    engine: sa.Engine, producer: Producer, meta_server: str, subject: str, clock: ManualClock
) -> None:
    create_outbox_tables(engine)
    messages = [Message(subject, body=f"m{i}") for i in range(5)]
    leave_rows(engine, messages, clock.now_ms())
    dog = Watchdog(producer, engine, threshold_ms=60_000, batch_rows=2, clock=clock)
    try:
        [report] = dog.run_once()
        assert (report.leased, report.sent) == (True, 0)
        clock.advance(61)
        [report] = dog.run_once()
        # Batches of 2 until the table is drained, within one pass.
        assert (report.sent, report.failed, report.blocked, report.error) == (5, 0, 0, None)
    finally:
        dog.close()
    assert outbox_rows(engine) == 0
    assert sorted(consume(meta_server, subject, 5)) == sorted((m.message_id, m.body) for m in messages)


def test_one_watchdog_holds_the_lease(pg: Database, producer: Producer, clock: ManualClock) -> None:
    engine = pg.engine()
    try:
        a = Watchdog(producer, engine, owner="dog-a", lease_ms=10_000, create_tables=True, clock=clock)
        b = Watchdog(producer, engine, owner="dog-b", lease_ms=10_000, clock=clock)
        assert [r.leased for r in a.run_once()] == [True]
        assert [r.leased for r in b.run_once()] == [False]
        assert [r.leased for r in a.run_once()] == [True], "the holder renews"
        clock.advance(11)  # a stopped renewing: its lease ran out
        assert [r.leased for r in b.run_once()] == [True]
        assert [r.leased for r in a.run_once()] == [False]
        b.close()  # gives the lease up: a takes over without waiting
        assert [r.leased for r in a.run_once()] == [True]
    finally:
        engine.dispose()


def test_racing_watchdogs_never_send_a_row_twice(
    server_db: Database, producer: Producer, meta_server: str, subject: str
) -> None:
    engine = server_db.engine(pool_size=4)
    counting = CountingProducer(producer)
    messages = [Message(subject, body=str(i)) for i in range(300)]
    try:
        create_outbox_tables(engine)
        leave_rows(engine, messages, int(time.time() * 1000) - 120_000)
        # A 1 ms lease is always expired: both watchdogs work at once, and only the per-row
        # claims keep them apart.
        dogs = [
            Watchdog(counting, engine, owner=f"dog-{i}", lease_ms=1, batch_rows=25, threshold_ms=1_000)
            for i in range(2)
        ]
        deadline = time.monotonic() + 30

        def drain(dog: Watchdog) -> int:
            sent = 0
            while outbox_rows(engine) and time.monotonic() < deadline:
                sent += sum(r.sent for r in dog.run_once())
            return sent

        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            sent_by = list(pool.map(drain, dogs))
        assert outbox_rows(engine) == 0
        assert sum(sent_by) == len(messages)
        assert all(n > 0 for n in sent_by), f"both watchdogs should have worked: {sent_by}"
        assert counting.sends == collections.Counter({m.message_id: 1 for m in messages})
        got = consume(meta_server, subject, len(messages))
        assert len(got) == len(messages) == len(set(got))
    finally:
        engine.dispose()


def test_a_failing_row_is_blocked_listed_and_unblocked(
    engine: sa.Engine, producer: Producer, subject: str, clock: ManualClock
) -> None:
    create_outbox_tables(engine)
    good = Message(subject, body="fine")
    leave_rows(engine, [good], clock.now_ms() - 120_000)
    # A row no producer can send: its subject column is not a valid subject.
    with engine.begin() as conn:
        conn.execute(
            outbox_table("qmq_msg_queue").insert(),
            {
                "message_id": "broken-1",
                "subject": "not a/subject",
                "content": good.encode(),
                "created_ms": clock.now_ms() - 120_000,
                "attempts": 0,
                "status": "pending",
                "next_attempt_ms": 0,
            },
        )
    dog = Watchdog(producer, engine, max_attempts=3, backoff_ms=1_000, clock=clock)
    try:
        [first] = dog.run_once()
        assert (first.sent, first.failed, first.blocked) == (1, 1, 0)
        [early] = dog.run_once()
        assert (early.sent, early.failed) == (0, 0), "backing off: not due yet"
        clock.advance(1.001)
        assert dog.run_once()[0].failed == 1
        clock.advance(2.001)
        assert dog.run_once()[0].blocked == 1
        clock.advance(3600)
        assert dog.run_once()[0].failed == 0, "a blocked row is not tried again"
    finally:
        dog.close()
    [(database, row)] = list_blocked([engine])
    assert (row.message_id, row.subject, row.attempts, row.status) == ("broken-1", "not a/subject", 3, "blocked")
    assert "not a/subject" in (row.last_error or "")
    assert database.startswith(engine.url.drivername)
    assert unblock([engine], ids=[row.id]) == 1
    assert list_blocked([engine]) == []
    assert outbox_rows(engine) == 1
