"""``TransactionalIdempotentChecker``: the "processed" record commits with the handler's own work.

The handler gets the connection of a transaction that already holds the message's record;
whatever it writes there commits together with the record, or rolls back together with it.
So a message is applied once even if the consumer dies after the commit and before its
acknowledgement: the redelivery finds the record and is skipped. Of two concurrent
deliveries, the second one's insert of the record waits for the first transaction, then
finds the record (skipped) or, if the first rolled back, goes ahead: no claims, no leases.

    def apply(message, conn):                 # conn: this transaction's Connection
        conn.execute(insert(ledger).values(...))

    checker.run(message, apply)               # Outcome.PROCESSED or Outcome.DUPLICATE

or, to write the handler inline::

    try:
        with checker.transaction(message) as conn:
            conn.execute(insert(ledger).values(...))
    except DuplicateMessageError:
        pass                                  # processed before: nothing to do

The handler must do its database work through ``conn``: work done on another connection
is not part of the transaction and is not protected.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.errors import ConfigError
from qmq.idempotency.base import (
    DEFAULT_TTL_MS,
    DuplicateMessageError,
    KeyFunction,
    M,
    MessageLike,
    Outcome,
    RecordKeys,
    check_ttl_ms,
)
from qmq.idempotency.table import DEFAULT_DEDUP_TABLE, STATE_DONE, Purger, Statements, dedup_table, record
from qmq.tx.portable import check_dialect

_PURGE_INTERVAL_MS_MAX = 86_400_000


class _Recorder:
    """What both variants share: the record of a message and the purge schedule."""

    def __init__(
        self,
        engine: sa.Engine,
        table: str,
        key: KeyFunction | None,
        group: str | None,
        ttl_ms: int,
        purge_interval_ms: int,
        clock: Clock,
    ) -> None:
        self.st = Statements(dedup_table(table), check_dialect(engine))
        self.keys = RecordKeys(key, group)
        self.ttl_ms = check_ttl_ms(ttl_ms)
        self.clock = clock
        self.purger = Purger(self.st, check_int("purge_interval_ms", purge_interval_ms, 1, _PURGE_INTERVAL_MS_MAX))

    def params(self, message: MessageLike) -> tuple[str, dict[str, object]]:
        key = self.keys.of(message)
        now = self.clock.now_ms()
        return key, record(key, STATE_DONE, None, now + self.ttl_ms, now)


class TransactionalIdempotentChecker:
    """Runs a handler in a transaction of ``engine`` that also records the message as processed.

    PostgreSQL, MariaDB/MySQL or SQLite; table ``table`` is created when absent. ``key``
    picks what identifies a message (default: its id); ``group`` keeps consumer groups
    sharing the table apart. Records are kept at least ``ttl_ms``.
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table: str = DEFAULT_DEDUP_TABLE,
        key: KeyFunction | None = None,
        group: str | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        purge_interval_ms: int = 60_000,
        create_table: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(engine, sa.Engine):
            raise ConfigError(
                f"engine={engine!r} must be a SQLAlchemy Engine; for an AsyncEngine use "
                "AsyncTransactionalIdempotentChecker"
            )
        self._engine = engine
        self._rec = _Recorder(engine, table, key, group, ttl_ms, purge_interval_ms, clock)
        self.table = self._rec.st.table
        if create_table:
            self.table.metadata.create_all(engine, checkfirst=True)

    def run(self, message: M, handler: Callable[[M, sa.Connection], object]) -> Outcome:
        """Call ``handler(message, conn)`` in a transaction that records the message, unless it was processed.

        The transaction commits if the handler returns and rolls back (record included) if
        it raises; the exception propagates.
        """
        _, values = self._rec.params(message)
        with self._engine.begin() as conn:
            if conn.execute(self._rec.st.insert, values).rowcount != 1:
                return Outcome.DUPLICATE
            handler(message, conn)
        self.purge_if_due()
        return Outcome.PROCESSED

    @contextlib.contextmanager
    def transaction(self, message: MessageLike) -> Iterator[sa.Connection]:
        """A transaction holding the message's record; raises ``DuplicateMessageError`` if processed before.

        Commits when the block ends, rolls back if it raises.
        """
        key, values = self._rec.params(message)
        with self._engine.begin() as conn:
            if conn.execute(self._rec.st.insert, values).rowcount != 1:
                raise DuplicateMessageError(message.message_id, key)
            yield conn
        self.purge_if_due()

    def purge_if_due(self) -> int:
        """Delete expired records if ``purge_interval_ms`` passed since the last purge; how many."""
        now = self._rec.clock.now_ms()
        return self._rec.purger.purge(self._engine, now) if self._rec.purger.due(now) else 0


class AsyncTransactionalIdempotentChecker:
    """``TransactionalIdempotentChecker`` over SQLAlchemy's ``AsyncEngine``, for asyncio consumers.

    ``await checker.run_async(message, handler)`` with ``async def handler(message, conn)``,
    or ``async with checker.transaction(message) as conn:``. The table is created on first
    use when absent.
    """

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        table: str = DEFAULT_DEDUP_TABLE,
        key: KeyFunction | None = None,
        group: str | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        purge_interval_ms: int = 60_000,
        create_table: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(engine, AsyncEngine):
            raise ConfigError(
                f"engine={engine!r} must be a SQLAlchemy AsyncEngine; for an Engine use TransactionalIdempotentChecker"
            )
        self._engine = engine
        self._rec = _Recorder(engine.sync_engine, table, key, group, ttl_ms, purge_interval_ms, clock)
        self.table = self._rec.st.table
        self._table_ready = not create_table
        self._create_lock = asyncio.Lock()

    async def run_async(self, message: M, handler: Callable[[M, AsyncConnection], Awaitable[object]]) -> Outcome:
        """Await ``handler(message, conn)`` in a transaction that records the message, unless it was processed."""
        if not self._table_ready:
            await self._create_table()
        _, values = self._rec.params(message)
        async with self._engine.begin() as conn:
            if (await conn.execute(self._rec.st.insert, values)).rowcount != 1:
                return Outcome.DUPLICATE
            await handler(message, conn)
        await self._purge_if_due()
        return Outcome.PROCESSED

    @contextlib.asynccontextmanager
    async def transaction(self, message: MessageLike) -> AsyncIterator[AsyncConnection]:
        """A transaction holding the message's record; raises ``DuplicateMessageError`` if processed before."""
        if not self._table_ready:
            await self._create_table()
        key, values = self._rec.params(message)
        async with self._engine.begin() as conn:
            if (await conn.execute(self._rec.st.insert, values)).rowcount != 1:
                raise DuplicateMessageError(message.message_id, key)
            yield conn
        await self._purge_if_due()

    async def _purge_if_due(self) -> int:
        now = self._rec.clock.now_ms()
        return await self._rec.purger.purge_async(self._engine, now) if self._rec.purger.due(now) else 0

    async def _create_table(self) -> None:
        async with self._create_lock:
            if not self._table_ready:
                async with self._engine.begin() as conn:
                    await conn.run_sync(self.table.metadata.create_all, checkfirst=True)
                self._table_ready = True
