"""The transactional checker: the record commits with the handler's work, or neither does; a
concurrent second delivery waits for the first transaction and then skips; sync and asyncio."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, create_async_engine

from qmq.client.message import Message
from qmq.common.clock import ManualClock
from qmq.idempotency import (
    AsyncTransactionalIdempotentChecker,
    DuplicateMessageError,
    Outcome,
    TransactionalIdempotentChecker,
)
from scratch_dbs import Database, fresh_database

_meta = sa.MetaData()
effects = sa.Table("effects", _meta, sa.Column("n", sa.Integer, primary_key=True), sa.Column("message_id", sa.Text))


class Boom(Exception):
    """A handler's failure, after it wrote its effect."""


def _effects(engine: sa.Engine) -> list[str]:
    with engine.connect() as conn:
        return list(conn.scalars(sa.select(effects.c.message_id).order_by(effects.c.n)))


def _apply(message: Message, conn: sa.Connection) -> None:
    conn.execute(effects.insert().values(message_id=message.message_id))


def _apply_then_fail(message: Message, conn: sa.Connection) -> None:
    _apply(message, conn)
    raise Boom


def test_work_and_record_commit_together(engine: sa.Engine) -> None:
    _meta.create_all(engine)
    checker = TransactionalIdempotentChecker(engine)
    m = Message("payments")
    with pytest.raises(Boom):
        checker.run(m, _apply_then_fail)
    assert _effects(engine) == [], "the failed handler's effect rolled back with the record"
    assert checker.run(m, _apply) is Outcome.PROCESSED
    assert checker.run(m, _apply) is Outcome.DUPLICATE
    assert _effects(engine) == [m.message_id]


def test_transaction_block(engine: sa.Engine) -> None:
    _meta.create_all(engine)
    checker = TransactionalIdempotentChecker(engine, group="ledger")
    m = Message("payments")
    with contextlib.suppress(Boom), checker.transaction(m) as conn:
        _apply_then_fail(m, conn)
    with checker.transaction(m) as conn:
        _apply(m, conn)
    ran: list[str] = []

    def again() -> None:
        with checker.transaction(m):
            ran.append("body")

    with pytest.raises(DuplicateMessageError, match="was processed already") as info:
        again()
    assert ran == []
    assert info.value.key == f"ledger/payments/{m.message_id}"
    assert _effects(engine) == [m.message_id]


def test_records_expire(engine: sa.Engine, clock: ManualClock) -> None:
    _meta.create_all(engine)
    checker = TransactionalIdempotentChecker(engine, ttl_ms=60_000, purge_interval_ms=1, clock=clock)
    m = Message("payments")
    assert checker.run(m, _apply) is Outcome.PROCESSED
    clock.advance(30)
    assert checker.purge_if_due() == 0
    clock.advance(30.001)
    assert checker.purge_if_due() == 1
    assert checker.run(m, _apply) is Outcome.PROCESSED, "forgotten after ttl_ms"


def _lock_waits(db: Database, app_name: str) -> Callable[[sa.Connection], int]:
    """How many of this test's connections wait for a row lock now."""
    if db.kind == "postgresql":
        query = sa.text(
            "SELECT COUNT(*) FROM pg_stat_activity WHERE application_name = :name AND wait_event_type = 'Lock'"
        )
        return lambda conn: int(conn.scalar(query, {"name": app_name}) or 0)
    query = sa.text(
        "SELECT COUNT(*) FROM information_schema.innodb_trx t JOIN information_schema.processlist p "
        "ON t.trx_mysql_thread_id = p.id WHERE t.trx_state = 'LOCK WAIT' AND p.db = :db"
    )
    database = sa.make_url(db.url).database
    return lambda conn: int(conn.scalar(query, {"db": database}) or 0)


@pytest.mark.parametrize("first_commits", [True, False], ids=["first-commits", "first-fails"])
def test_a_concurrent_delivery_waits_then_skips_or_takes_over(server_db: Database, first_commits: bool) -> None:
    app_name = f"qmq-idem-{time.monotonic_ns()}"
    connect_args = {"application_name": app_name} if server_db.kind == "postgresql" else {}
    engine = server_db.engine(connect_args=connect_args)
    observer = server_db.engine()
    try:
        _meta.create_all(engine)
        checker = TransactionalIdempotentChecker(engine)
        m = Message("payments")
        inside, release = threading.Event(), threading.Event()
        outcomes: dict[str, Outcome | BaseException] = {}

        def first(msg: Message, conn: sa.Connection) -> None:
            _apply(msg, conn)
            inside.set()
            assert release.wait(20)
            if not first_commits:
                raise Boom

        def deliver(name: str, handler: Callable[[Message, sa.Connection], None]) -> None:
            try:
                outcomes[name] = checker.run(m, handler)
            except BaseException as exc:
                outcomes[name] = exc

        a = threading.Thread(target=deliver, args=("first", first))
        a.start()
        assert inside.wait(20)
        b = threading.Thread(target=deliver, args=("second", _apply))
        b.start()
        waiting = _lock_waits(server_db, app_name)
        deadline = time.monotonic() + 20
        try:
            with observer.connect() as conn:
                while waiting(conn) < 1:
                    assert time.monotonic() < deadline, "the second delivery never waited for the first's lock"
                    # InnoDB refreshes information_schema.innodb_trx only when nobody read it for
                    # 100 ms: polling faster would keep reading the snapshot taken before the wait.
                    time.sleep(0.15)  # polling a condition, bounded by the deadline
        finally:
            release.set()
            a.join(20)
            b.join(20)
        if first_commits:
            assert outcomes == {"first": Outcome.PROCESSED, "second": Outcome.DUPLICATE}
        else:
            assert isinstance(outcomes["first"], Boom)
            assert outcomes["second"] is Outcome.PROCESSED
        assert _effects(engine) == [m.message_id]
    finally:
        engine.dispose()
        observer.dispose()


@pytest.fixture(params=["sqlite", "postgresql"])
async def async_engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    with contextlib.contextmanager(fresh_database)(request.param, tmp_path) as db:
        engine = create_async_engine(db.async_url)
        try:
            yield engine
        finally:
            await engine.dispose()


async def test_async_checker(async_engine: AsyncEngine) -> None:
    async with async_engine.begin() as conn:
        await conn.run_sync(_meta.create_all)
    checker = AsyncTransactionalIdempotentChecker(async_engine)
    m = Message("payments")

    async def apply(msg: Message, conn: AsyncConnection) -> None:
        await conn.execute(effects.insert().values(message_id=msg.message_id))

    async def apply_then_fail(msg: Message, conn: AsyncConnection) -> None:
        await apply(msg, conn)
        raise Boom

    with pytest.raises(Boom):
        await checker.run_async(m, apply_then_fail)
    assert await checker.run_async(m, apply) is Outcome.PROCESSED
    assert await checker.run_async(m, apply) is Outcome.DUPLICATE
    with pytest.raises(DuplicateMessageError):
        async with checker.transaction(m):
            pass
    other = Message("payments")
    async with checker.transaction(other) as conn:
        await apply(other, conn)
    async with async_engine.connect() as conn:
        seen = list(await conn.scalars(sa.select(effects.c.message_id).order_by(effects.c.n)))
    assert seen == [m.message_id, other.message_id]
