"""The asyncio transactional producer (``qmq.aio.tx``) over SQLAlchemy's AsyncEngine, against a
real `qmq standalone`: aiosqlite and psycopg's async mode."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine, AsyncSession, create_async_engine

from qmq.aio import Consumer, Message, Producer
from qmq.aio.tx import TransactionalProducer
from qmq.common.errors import QmqError
from scratch_dbs import fresh_database

pytestmark = pytest.mark.integration


class Rollback(Exception):
    """Raised inside a transaction block to roll it back."""


@pytest.fixture(params=["sqlite", "postgresql"])
async def async_engine(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[AsyncEngine]:
    with contextlib.contextmanager(fresh_database)(request.param, tmp_path) as db:
        engine = create_async_engine(db.async_url)
        try:
            yield engine
        finally:
            await engine.dispose()


async def _outbox_rows(engine: AsyncEngine) -> int:
    async with engine.connect() as conn:
        return int(await conn.scalar(sa.text("SELECT COUNT(*) FROM qmq_msg_queue")) or 0)


@pytest.mark.smoke
async def test_commit_sends_and_rollback_does_not(async_engine: AsyncEngine, meta_server: str, subject: str) -> None:
    async with (
        Producer(app_code="tx-tests", meta_server=meta_server) as producer,
        Consumer(app_code="tx-tests", meta_server=meta_server) as consumer,
        TransactionalProducer(producer, async_engine, create_table=True) as tx,
    ):
        pull = consumer.pull_consumer(subject, "tx-tests", start_from="earliest")
        first, dropped, last = Message(subject, body="1"), Message(subject, body="2"), Message(subject, body="3")
        async with async_engine.begin() as conn:
            await tx.send(conn, first)
        with contextlib.suppress(Rollback):
            async with async_engine.begin() as conn:
                await tx.send(conn, dropped)
                raise Rollback
        async with AsyncSession(async_engine) as session:
            await tx.send(session, last)
            await session.commit()

        got: list[str] = []
        async with asyncio.timeout(20):
            while len(got) < 2:
                batch = await pull.pull(max_messages=10, timeout_ms=1000)
                got.extend(m.message_id for m in batch)
                await batch.ack_all()
        assert sorted(got) == sorted([first.message_id, last.message_id])
        async with asyncio.timeout(10):
            while True:
                if await _outbox_rows(async_engine) == 0:
                    break
                await asyncio.sleep(0.02)  # polling a condition, bounded by the timeout
    assert (tx.messages_sent, tx.messages_failed) == (2, 0)


async def test_send_needs_start(async_engine: AsyncEngine, meta_server: str, subject: str) -> None:
    async with Producer(app_code="tx-tests", meta_server=meta_server) as producer:
        tx = TransactionalProducer(producer, async_engine)
        async with async_engine.begin() as conn:
            with pytest.raises(QmqError, match="async with TransactionalProducer"):
                await tx.send(conn, Message(subject))


class _Unprintable(Exception):
    def __str__(self) -> str:
        raise RuntimeError("this exception's text cannot be read")


async def test_the_finish_loop_survives_any_outcome_and_close_is_prompt(
    async_engine: AsyncEngine, meta_server: str, subject: str
) -> None:
    # A send outcome whose error cannot even be turned into text, or holds a lone surrogate
    # that the database driver refuses: once, either ended the loop that deletes sent rows,
    # and close() then waited out its whole timeout.
    async with (
        Producer(app_code="tx-tests", meta_server=meta_server) as producer,
        TransactionalProducer(producer, async_engine, create_table=True) as tx,
    ):
        tx._outcome(10**9, _Unprintable())
        tx._outcome(10**9 + 1, OSError("/data/\udcff.csv"))
        async with async_engine.begin() as conn:
            await tx.send(conn, Message(subject, body="after"))
        async with asyncio.timeout(10):
            while True:
                if await _outbox_rows(async_engine) == 0:
                    break
                await asyncio.sleep(0.02)  # polling a condition, bounded by the timeout
        started = asyncio.get_running_loop().time()
    assert asyncio.get_running_loop().time() - started < 5
    assert tx.messages_sent == 1
