"""``TransactionalProducer``: send a message if, and only if, the application's transaction commits.

``send(conn, message)`` writes the encoded message into the outbox table through the
application's own connection, so the row commits or rolls back with the business data.
After the commit (``qmq.tx.hooks``) the message goes to the producer at once without
waiting (``send_async``), and once the broker has stored it the row is deleted in a
separate short transaction (``qmq.tx.finisher``). After a rollback nothing is sent. If
the process dies after the commit, or the broker is down, the row stays and ``qmq
watchdog`` sends it later; a send repeated after all is dropped by the broker's duplicate
window, which keys on the message id the row keeps. For that, every send of a row, this
one and the watchdog's, is a resend (``send_async(..., resend=True)``): it goes only to the
broker group the message id picks, and waits for that group rather than fail over to
another, which would store a second copy (found by the fault campaign: a row whose
after-commit send failed over while a master was cut off, then stored again by the
watchdog in the group its id picks).
"""

from __future__ import annotations

import concurrent.futures
import functools
import logging
import threading
import time
from types import TracebackType
from typing import Protocol

import sqlalchemy as sa
from sqlalchemy.orm import Session

from qmq.client.message import Message
from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.errors import ConfigError, QmqError
from qmq.tx import hooks
from qmq.tx.finisher import Finisher, FinisherStats
from qmq.tx.portable import check_dialect
from qmq.tx.rows import row_values
from qmq.tx.schema import (
    DEFAULT_LEASE_TABLE,
    DEFAULT_OUTBOX_TABLE,
    check_table_name,
    create_outbox_tables,
    outbox_table,
)
from qmq.tx.stored import StoredMessage

log = logging.getLogger(__name__)

_CLOSE_TIMEOUT_MS = 10_000


class SendsAsync(Protocol):
    """What the transactional producer and the watchdog need of ``qmq.Producer`` (the blocking
    SDK). Every send of an outbox row is made with ``resend=True``: a row may have been sent
    before (the send's answer lost, the process killed before the row was deleted), so it goes
    only to the broker group its message id picks, whose duplicate window drops a repeat."""

    def send_async(self, message: Message, *, resend: bool = False) -> concurrent.futures.Future[None]: ...


def connection_of(conn: sa.Connection | Session) -> sa.Connection:
    """The Connection a Session's transaction runs on (its default bind), or ``conn`` itself."""
    if isinstance(conn, Session):
        return conn.connection()
    if isinstance(conn, sa.Connection):
        return conn
    raise ConfigError(
        f"send() needs the SQLAlchemy Connection or Session of the application's transaction, got {conn!r}"
    )


def check_not_autocommit(conn: sa.Connection) -> None:
    level = conn.get_execution_options().get("isolation_level") or getattr(conn.dialect, "isolation_level", None)
    if level == "AUTOCOMMIT":
        raise ConfigError(
            "the connection is in AUTOCOMMIT mode, so the outbox row would not share a transaction with "
            "the application's data; use a connection with a transaction (`with engine.begin() as conn:`)"
        )


class TransactionalProducer:
    """Sends messages that commit with the application's own database transaction.

    ``producer`` is a started ``qmq.Producer``; ``engine`` the application's SQLAlchemy
    engine (PostgreSQL, MariaDB/MySQL or SQLite). ``create_table=True`` creates the outbox
    tables when absent (else run ``qmq tx init --db URL``). Close it before the producer.
    """

    def __init__(
        self,
        producer: SendsAsync,
        engine: sa.Engine,
        *,
        table: str = DEFAULT_OUTBOX_TABLE,
        create_table: bool = False,
        lease_table: str = DEFAULT_LEASE_TABLE,
        finish_queue_max: int = 10_000,
        finish_batch_max: int = 500,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        if not isinstance(engine, sa.Engine):
            raise ConfigError(
                f"engine={engine!r} must be a SQLAlchemy Engine; "
                "for an AsyncEngine use qmq.aio.tx.TransactionalProducer"
            )
        check_dialect(engine)
        self._producer = producer
        self._engine = engine
        self._table = outbox_table(check_table_name(table))
        self._insert = self._table.insert()
        self._clock = clock
        check_int("finish_queue_max", finish_queue_max, 1, 10_000_000)
        check_int("finish_batch_max", finish_batch_max, 1, 10_000)
        if create_table:
            create_outbox_tables(engine, table, check_table_name(lease_table, "lease_table"))
        hooks.install(engine)
        self._finisher = Finisher(engine, self._table, queue_max=finish_queue_max, batch_max=finish_batch_max)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._in_flight = 0
        self._closed = False
        self.messages_sent = 0
        self.messages_failed = 0

    @property
    def table(self) -> str:
        return self._table.name

    @property
    def finisher_stats(self) -> FinisherStats:
        return self._finisher.stats

    def send(self, conn: sa.Connection | Session, message: Message) -> None:
        """Write ``message`` into the outbox within ``conn``'s transaction; it is sent after the commit.

        ``conn`` is the Connection (or Session) the application writes its data with. The
        message is encoded now: changing it afterwards changes nothing that is sent.
        """
        if self._closed:
            raise QmqError("this TransactionalProducer is closed; make a new one")
        connection = connection_of(conn)
        check_not_autocommit(connection)
        if connection.engine.dialect is not self._engine.dialect:
            raise ConfigError(
                f"the connection belongs to engine {connection.engine.url.render_as_string()!r}, not to the engine "
                "this TransactionalProducer was made with; the outbox row must be in the same transaction"
            )
        encoded = message.encode()
        result = connection.execute(
            self._insert, row_values(message.message_id, message.subject, encoded, self._clock.now_ms())
        )
        key = result.inserted_primary_key
        assert key is not None
        row_id = int(key[0])
        stored = StoredMessage(message.subject, message.message_id, encoded)
        hooks.call_after_commit(connection, functools.partial(self._dispatch, row_id, stored))

    def _dispatch(self, row_id: int, stored: StoredMessage) -> None:
        # Runs inside the application's commit call: hand over and return, never block.
        try:
            fut = self._producer.send_async(stored, resend=True)
        except QmqError as exc:
            log.warning(
                "outbox row %d (message %s) not sent after commit: %s; a watchdog will send it",
                row_id,
                stored.message_id,
                exc,
            )
            with self._lock:
                self.messages_failed += 1
            self._finisher.failed(row_id, exc)
            return
        with self._lock:
            self._in_flight += 1
        fut.add_done_callback(functools.partial(self._on_sent, row_id))

    def _on_sent(self, row_id: int, fut: concurrent.futures.Future[None]) -> None:
        # On the producer's I/O thread: queue the outcome, nothing else.
        exc = fut.exception() if not fut.cancelled() else concurrent.futures.CancelledError()
        if exc is None:
            self._finisher.sent(row_id)
        else:
            log.warning("outbox row %d not sent after commit: %s; a watchdog will send it", row_id, exc)
            self._finisher.failed(row_id, exc)
        with self._lock:
            if exc is None:
                self.messages_sent += 1
            else:
                self.messages_failed += 1
            self._in_flight -= 1
            if self._in_flight == 0:
                self._idle.notify_all()

    def close(self, timeout_ms: int = _CLOSE_TIMEOUT_MS) -> None:
        """Wait for sends in flight and their row deletions (up to ``timeout_ms`` each), then stop.

        Rows whose outcome is not known by then stay in the outbox for the watchdog.
        """
        deadline = time.monotonic() + timeout_ms / 1000
        with self._lock:
            self._closed = True
            while self._in_flight and (left := deadline - time.monotonic()) > 0:
                self._idle.wait(left)
            if self._in_flight:
                log.warning("outbox: %d send(s) still in flight at close; a watchdog will finish them", self._in_flight)
        self._finisher.close(max(0.0, deadline - time.monotonic()) + timeout_ms / 1000)

    def __enter__(self) -> TransactionalProducer:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
