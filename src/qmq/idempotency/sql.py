"""``SqlIdempotentChecker``: records in a database table, apart from the handler's own work.

For handlers whose effects are not in that database (a call to another service, a file):
the record is claimed before the handler runs and marked done after it returned, each in
its own short transaction. A crash between the handler's effect and the "done" record
means the message is processed again once the claim's lease expired; when the effects are
in the same database, use ``TransactionalIdempotentChecker``, which has no such gap.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import sqlalchemy as sa

from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.idempotency.base import (
    CLAIM_ATTEMPTS_MAX,
    DEFAULT_LEASE_MS,
    DEFAULT_TTL_MS,
    Claim,
    KeyFunction,
    M,
    Outcome,
    RecordKeys,
    check_lease_ms,
    check_ttl_ms,
    run_claimed,
)
from qmq.idempotency.table import (
    DEFAULT_DEDUP_TABLE,
    STATE_DONE,
    STATE_PROCESSING,
    Purger,
    Statements,
    dedup_table,
    record,
)
from qmq.tx.portable import check_dialect

log = logging.getLogger(__name__)

_PURGE_INTERVAL_MS_MAX = 86_400_000


class _SqlStore:
    def __init__(self, engine: sa.Engine, st: Statements, ttl_ms: int, lease_ms: int, clock: Clock) -> None:
        self._engine = engine
        self._st = st
        self._ttl_ms = ttl_ms
        self._lease_ms = lease_ms
        self._clock = clock

    def claim(self, key: str, token: str) -> Claim:
        # One statement per transaction: MySQL's INSERT IGNORE keeps a shared lock on the row
        # it found, and an UPDATE after it in the same transaction could deadlock with a
        # second delivery doing the same.
        st = self._st
        for _ in range(CLAIM_ATTEMPTS_MAX):
            now = self._clock.now_ms()
            until = now + self._lease_ms
            with self._engine.begin() as conn:
                if conn.execute(st.insert, record(key, STATE_PROCESSING, token, until, now)).rowcount == 1:
                    return Claim.CLAIMED
            # A claim whose lease ran out (its consumer died), or a record past its TTL.
            with self._engine.begin() as conn:
                taken = conn.execute(st.take_expired, {"key": key, "now": now, "token": token, "until": until})
                if taken.rowcount == 1:
                    return Claim.CLAIMED
            with self._engine.connect() as conn:
                row = conn.execute(st.state_of, {"key": key}).first()
            if row is not None:
                return Claim.DONE if row[0] == STATE_DONE else Claim.BUSY
            # Released between our statements: look again.
        return Claim.BUSY

    def finish(self, key: str, token: str) -> None:
        st = self._st
        now = self._clock.now_ms()
        until = now + self._ttl_ms
        with self._engine.begin() as conn:
            if conn.execute(st.finish, {"key": key, "token": token, "until": until}).rowcount == 1:
                return
            log.warning(
                "the claim on %r expired while its handler ran (lease_ms=%d is shorter than the handler); "
                "another consumer may have processed the message too",
                key,
                self._lease_ms,
            )
            if conn.execute(st.mark_done, {"key": key, "until": until}).rowcount == 0:
                conn.execute(st.insert, record(key, STATE_DONE, None, until, now))

    def release(self, key: str, token: str) -> None:
        with self._engine.begin() as conn:
            conn.execute(self._st.release, {"key": key, "token": token})


class SqlIdempotentChecker:
    """Skips messages processed successfully before, recorded in table ``table`` of ``engine``.

    PostgreSQL, MariaDB/MySQL or SQLite; the table is created when absent. Records are kept
    ``ttl_ms`` after processing; ``lease_ms`` must be longer than the handler ever runs.
    ``key`` picks what identifies a message (default: its id); ``group`` keeps consumer
    groups sharing the table apart.
    """

    def __init__(
        self,
        engine: sa.Engine,
        *,
        table: str = DEFAULT_DEDUP_TABLE,
        key: KeyFunction | None = None,
        group: str | None = None,
        ttl_ms: int = DEFAULT_TTL_MS,
        lease_ms: int = DEFAULT_LEASE_MS,
        purge_interval_ms: int = 60_000,
        create_table: bool = True,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        dialect = check_dialect(engine)
        self._engine = engine
        self._keys = RecordKeys(key, group)
        self._clock = clock
        self.table = dedup_table(table)
        if create_table:
            self.table.metadata.create_all(engine, checkfirst=True)
        st = Statements(self.table, dialect)
        self._store = _SqlStore(engine, st, check_ttl_ms(ttl_ms), check_lease_ms(lease_ms), clock)
        self._purger = Purger(st, check_int("purge_interval_ms", purge_interval_ms, 1, _PURGE_INTERVAL_MS_MAX))

    def run(self, message: M, handler: Callable[[M], object]) -> Outcome:
        """Call ``handler(message)`` unless the message was processed; record it if the handler returns."""
        outcome = run_claimed(self._store, self._keys, message, handler)
        self.purge_if_due()
        return outcome

    def purge_if_due(self) -> int:
        """Delete expired records if ``purge_interval_ms`` passed since the last purge; how many."""
        now = self._clock.now_ms()
        return self._purger.purge(self._engine, now) if self._purger.due(now) else 0
