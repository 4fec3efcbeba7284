"""Transactional sends for asyncio applications: ``qmq.aio.tx.TransactionalProducer``.

The same outbox as ``qmq.tx`` (same table, same watchdog) over SQLAlchemy's asyncio engine
(asyncpg or psycopg's async mode, aiomysql, aiosqlite) and ``qmq.aio.Producer``::

    async with TransactionalProducer(producer, async_engine) as tx_producer:
        async with async_engine.begin() as conn:
            await conn.execute(insert(payments).values(...))
            await tx_producer.send(conn, msg)
        # committed: sent at once, its outbox row deleted once stored

After the commit the message goes to ``producer.send_nowait(..., resend=True)`` (inside the
commit call, on the event loop's thread, never awaiting; only to the broker group its id
picks, as the watchdog's sends, see ``qmq.tx.producer``); a task deletes the rows of stored
messages in batches from a bounded queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from types import TracebackType
from typing import Literal, Protocol

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine, AsyncSession

from qmq.client.message import Message
from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.errors import ConfigError, QmqError
from qmq.tx import hooks
from qmq.tx.finisher import FinisherStats
from qmq.tx.portable import check_dialect
from qmq.tx.producer import check_not_autocommit
from qmq.tx.rows import delete_rows, failure_params, record_failure, row_values
from qmq.tx.schema import (
    DEFAULT_LEASE_TABLE,
    DEFAULT_OUTBOX_TABLE,
    check_table_name,
    create_outbox_tables,
    outbox_table,
)
from qmq.tx.stored import StoredMessage

__all__ = ["TransactionalProducer"]

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_MS = 10_000
_State = Literal["new", "open", "closed"]


class SendsNowait(Protocol):
    """What the transactional producer needs of ``qmq.aio.Producer``."""

    def send_nowait(self, message: Message, *, resend: bool = False) -> asyncio.Future[None]: ...


class TransactionalProducer:
    """Sends messages that commit with the application's own transaction (asyncio).

    ``producer`` is a started ``qmq.aio.Producer``; ``engine`` the application's
    ``AsyncEngine``. Use as ``async with`` (or ``await start()`` / ``await close()``);
    ``create_table=True`` creates the outbox tables at start when absent.
    """

    def __init__(
        self,
        producer: SendsNowait,
        engine: AsyncEngine,
        *,
        table: str = DEFAULT_OUTBOX_TABLE,
        create_table: bool = False,
        lease_table: str = DEFAULT_LEASE_TABLE,
        finish_queue_max: int = 10_000,
        finish_batch_max: int = 500,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigError(
                f"engine={engine!r} must be a SQLAlchemy AsyncEngine; for an Engine use qmq.tx.TransactionalProducer"
            )
        check_dialect(engine.sync_engine)
        self._producer = producer
        self._engine = engine
        self._table = outbox_table(check_table_name(table))
        self._lease_table = check_table_name(lease_table, "lease_table")
        self._insert = self._table.insert()
        self._delete = delete_rows(self._table)
        self._record_failure = record_failure(self._table)
        self._create_table = create_table
        self._clock = clock
        self._queue_max = check_int("finish_queue_max", finish_queue_max, 1, 10_000_000)
        self._batch_max = check_int("finish_batch_max", finish_batch_max, 1, 10_000)
        hooks.install(engine.sync_engine)
        self._state: _State = "new"
        self._queue: asyncio.Queue[tuple[int, BaseException | None]] | None = None
        self._finisher: asyncio.Task[None] | None = None
        self._in_flight = 0
        self._idle: asyncio.Event | None = None
        self.finisher_stats = FinisherStats()
        self.messages_sent = 0
        self.messages_failed = 0

    @property
    def table(self) -> str:
        return self._table.name

    async def start(self) -> None:
        """Create the tables if asked, start the task that deletes sent rows."""
        if self._state == "open":
            return
        if self._state == "closed":
            raise QmqError("this TransactionalProducer is closed; make a new one")
        if self._create_table:
            async with self._engine.begin() as conn:
                await conn.run_sync(create_outbox_tables, self._table.name, self._lease_table)
        self._queue = asyncio.Queue(self._queue_max)
        self._idle = asyncio.Event()
        self._idle.set()
        self._finisher = asyncio.ensure_future(self._finish_loop())
        self._finisher.add_done_callback(_finisher_ended)
        self._state = "open"

    async def __aenter__(self) -> TransactionalProducer:
        await self.start()
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def send(self, conn: AsyncConnection | AsyncSession, message: Message) -> None:
        """Write ``message`` into the outbox within ``conn``'s transaction; it is sent after the commit."""
        if self._state != "open":
            raise QmqError(
                "this TransactionalProducer is not open; use `async with TransactionalProducer(...)` "
                "or `await tx_producer.start()`"
            )
        if isinstance(conn, AsyncSession):
            conn = await conn.connection()
        if not isinstance(conn, AsyncConnection):
            raise ConfigError(
                f"send() needs the AsyncConnection or AsyncSession of the application's transaction, got {conn!r}"
            )
        sync_conn = conn.sync_connection
        assert sync_conn is not None
        check_not_autocommit(sync_conn)
        if sync_conn.engine.dialect is not self._engine.sync_engine.dialect:
            raise ConfigError(
                f"the connection belongs to engine {sync_conn.engine.url.render_as_string()!r}, not to the engine "
                "this TransactionalProducer was made with; the outbox row must be in the same transaction"
            )
        encoded = message.encode()
        result = await conn.execute(
            self._insert, row_values(message.message_id, message.subject, encoded, self._clock.now_ms())
        )
        key = result.inserted_primary_key
        assert key is not None
        stored = StoredMessage(message.subject, message.message_id, encoded)
        hooks.call_after_commit(sync_conn, functools.partial(self._dispatch, int(key[0]), stored))

    def _dispatch(self, row_id: int, stored: StoredMessage) -> None:
        # Inside the application's commit, on the loop's thread: hand over, never await.
        try:
            fut = self._producer.send_nowait(stored, resend=True)
        except QmqError as exc:
            log.warning(
                "outbox row %d (message %s) not sent after commit: %s; a watchdog will send it",
                row_id,
                stored.message_id,
                exc,
            )
            self.messages_failed += 1
            self._outcome(row_id, exc)
            return
        self._in_flight += 1
        assert self._idle is not None
        self._idle.clear()
        fut.add_done_callback(functools.partial(self._on_sent, row_id))

    def _on_sent(self, row_id: int, fut: asyncio.Future[None]) -> None:
        exc: BaseException | None = asyncio.CancelledError() if fut.cancelled() else fut.exception()
        if exc is None:
            self.messages_sent += 1
        else:
            self.messages_failed += 1
            log.warning("outbox row %d not sent after commit: %s; a watchdog will send it", row_id, exc)
        self._outcome(row_id, exc)
        self._in_flight -= 1
        if self._in_flight == 0 and self._idle is not None:
            self._idle.set()

    def _outcome(self, row_id: int, exc: BaseException | None) -> None:
        if self._queue is None:
            return
        try:
            self._queue.put_nowait((row_id, exc))
        except asyncio.QueueFull:
            self.finisher_stats.outcomes_dropped += 1
            log.warning("outbox: finisher queue full; row %d stays for the watchdog", row_id)

    async def _finish_loop(self) -> None:
        assert self._queue is not None
        queue = self._queue
        while True:
            batch = [await queue.get()]
            while len(batch) < self._batch_max and not queue.empty():
                batch.append(queue.get_nowait())
            try:
                await self._apply(batch)
            except Exception:  # a bug or an unexpected driver error costs this batch, not the loop
                self.finisher_stats.outcomes_dropped += len(batch)
                log.exception("outbox: applying %d send outcome(s) failed; the watchdog resends those rows", len(batch))
            finally:
                for _ in batch:
                    queue.task_done()

    async def _apply(self, batch: list[tuple[int, BaseException | None]]) -> None:
        sent = [row_id for row_id, exc in batch if exc is None]
        failed = [failure_params(row_id, exc) for row_id, exc in batch if exc is not None]
        try:
            async with self._engine.begin() as conn:
                if sent:
                    await conn.execute(self._delete, {"ids": sent})
                if failed:
                    await conn.execute(self._record_failure, failed)
        except sa.exc.SQLAlchemyError as exc:
            self.finisher_stats.outcomes_dropped += len(batch)
            log.warning(
                "outbox: applying %d send outcome(s) failed (%s); the watchdog resends those rows", len(batch), exc
            )
            return
        self.finisher_stats.rows_deleted += len(sent)
        self.finisher_stats.failures_recorded += len(failed)

    async def close(self, timeout_ms: int = _CLOSE_TIMEOUT_MS) -> None:
        """Wait for sends in flight and their row deletions (up to ``timeout_ms``), then stop."""
        if self._state != "open":
            self._state = "closed"
            return
        self._state = "closed"
        assert self._idle is not None
        assert self._queue is not None
        assert self._finisher is not None
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout_ms / 1000):
                await self._idle.wait()
                await self._queue.join()
        if self._in_flight or not self._queue.empty():
            log.warning("outbox: closing with sends or deletions unfinished; the watchdog finishes them")
        self._finisher.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._finisher


def _finisher_ended(task: asyncio.Task[None]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.critical("outbox: the loop that deletes sent rows stopped (%r); the watchdog sends what is left", exc)
