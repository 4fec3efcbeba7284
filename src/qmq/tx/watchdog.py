"""``Watchdog``: resend outbox rows an application committed but did not get sent.

A row older than ``threshold_ms`` is one whose after-commit send never finished: the
process died right after the commit, or the broker was down. Each pass, for each database:

1. take (or renew) the lease on the outbox table (``qmq.tx.lease``); without it, skip;
2. read up to ``batch_rows`` due rows, oldest first, and claim each with a compare-and-set
   UPDATE that counts the attempt and moves ``next_attempt_ms`` past the send (``claim_ms``),
   so no other watchdog touches a claimed row even if the lease changes hands;
3. send the claimed rows' stored bytes and wait for the answers (at most ``send_wait_ms``);
4. delete the rows that were stored; for the others record the error and the next attempt
   (exponential back-off, capped), or mark them blocked once ``attempts`` reached
   ``max_attempts``.

At most ``batches_per_pass`` batches run per database per pass. A row resent although it
had been delivered is dropped by the broker's duplicate window (same message id, subject
and attempt), as long as the threshold is well below the broker's ``dedup_window_ms``: every
send is a resend (``resend=True``), made only to the broker group the message id picks, the
one the first send went to, even while that group takes no sends.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass

import sqlalchemy as sa

from qmq.client.options import check_int
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.errors import ConfigError
from qmq.tx.lease import Lease, default_owner
from qmq.tx.portable import check_dialect
from qmq.tx.producer import SendsAsync
from qmq.tx.rows import (
    OutboxRow,
    after_failure,
    blocked_rows,
    claim_row,
    delete_rows,
    due_rows,
    to_row,
    unblock_rows,
)
from qmq.tx.schema import (
    DEFAULT_LEASE_TABLE,
    DEFAULT_OUTBOX_TABLE,
    STATUS_BLOCKED,
    STATUS_PENDING,
    check_table_name,
    create_outbox_tables,
    lease_table,
    outbox_table,
    truncate_error,
)
from qmq.tx.stored import StoredMessage

log = logging.getLogger(__name__)

_HOUR_MS = 3_600_000
_DAY_MS = 24 * _HOUR_MS


@dataclass(slots=True)
class PassReport:
    """What one pass did on one database."""

    database: str
    leased: bool = False
    sent: int = 0
    failed: int = 0
    blocked: int = 0
    claims_lost: int = 0
    more: bool = False
    """The pass stopped at ``batches_per_pass`` with rows possibly left: pass again at once."""
    error: str | None = None

    @property
    def busy(self) -> bool:
        return bool(self.sent or self.failed or self.blocked)


class Watchdog:
    """Resends old outbox rows of one or more databases through a ``qmq.Producer``.

    ``run_once()`` makes one pass over every database; ``run(stop)`` passes every
    ``interval_ms`` until ``stop`` is set. ``close()`` gives up the leases.
    """

    def __init__(
        self,
        producer: SendsAsync,
        engines: sa.Engine | Sequence[sa.Engine],
        *,
        table: str = DEFAULT_OUTBOX_TABLE,
        lease_table_name: str = DEFAULT_LEASE_TABLE,
        threshold_ms: int = 60_000,
        max_attempts: int = 10,
        batch_rows: int = 100,
        batches_per_pass: int = 10,
        interval_ms: int = 1_000,
        lease_ms: int = 60_000,
        send_wait_ms: int = 30_000,
        backoff_ms: int = 1_000,
        backoff_ms_max: int = 60_000,
        create_tables: bool = False,
        owner: str | None = None,
        clock: Clock = SYSTEM_CLOCK,
    ) -> None:
        self._engines = [engines] if isinstance(engines, sa.Engine) else list(engines)
        if not self._engines:
            raise ConfigError("a watchdog needs at least one database (--db URL)")
        for engine in self._engines:
            check_dialect(engine)
        self._producer = producer
        self.threshold_ms = check_int("threshold_ms", threshold_ms, 0, _DAY_MS)
        self.max_attempts = check_int("max_attempts", max_attempts, 1, 1_000_000)
        self.batch_rows = check_int("batch_rows", batch_rows, 1, 10_000)
        self.batches_per_pass = check_int("batches_per_pass", batches_per_pass, 1, 1_000)
        self.interval_ms = check_int("interval_ms", interval_ms, 1, _HOUR_MS)
        self.send_wait_ms = check_int("send_wait_ms", send_wait_ms, 1, _HOUR_MS)
        self.backoff_ms = check_int("backoff_ms", backoff_ms, 1, _HOUR_MS)
        self.backoff_ms_max = check_int("backoff_ms_max", backoff_ms_max, self.backoff_ms, _DAY_MS)
        check_int("lease_ms", lease_ms, 1, _HOUR_MS)
        # A claimed row stays off limits until well after the watchdog stopped waiting for it.
        self.claim_ms = 2 * self.send_wait_ms
        self.owner = owner or default_owner()
        self._clock = clock
        self._table = outbox_table(check_table_name(table))
        leases = self._lease_table = lease_table(check_table_name(lease_table_name, "lease_table"))
        if create_tables:
            for engine in self._engines:
                create_outbox_tables(engine, table, lease_table_name)
        self._leases = [Lease(engine, leases, table, self.owner, lease_ms) for engine in self._engines]
        self._due = due_rows(self._table)
        self._claim = claim_row(self._table)
        self._delete = delete_rows(self._table)
        self._after_failure = after_failure(self._table)

    def run_once(self) -> list[PassReport]:
        """One pass over every database; a database that fails is reported, not raised."""
        reports = []
        for engine, lease in zip(self._engines, self._leases, strict=True):
            report = PassReport(database=engine.url.render_as_string(hide_password=True))
            try:
                self._pass(engine, lease, report)
            except sa.exc.SQLAlchemyError as exc:
                report.error = f"{exc.__class__.__name__}: {exc}"
                if not self._has_tables(engine):
                    report.error = (
                        f"outbox table {self._table.name} or its lease table is missing; create them with "
                        f"`qmq tx init --db URL --table {self._table.name}`"
                    )
                log.warning("watchdog: database %s failed this pass: %s", report.database, report.error)
            if report.busy:
                log.info(
                    "watchdog: %s resent %d, failed %d, blocked %d",
                    report.database,
                    report.sent,
                    report.failed,
                    report.blocked,
                )
            reports.append(report)
        return reports

    def run(self, stop: threading.Event) -> None:
        """Pass every ``interval_ms`` (at once again while a pass had a full batch) until ``stop`` is set."""
        log.info(
            "watchdog %s: resending %s rows older than %d ms in %d database(s)",
            self.owner,
            self._table.name,
            self.threshold_ms,
            len(self._engines),
        )
        while not stop.is_set():
            reports = self.run_once()
            if not any(r.more for r in reports):
                stop.wait(self.interval_ms / 1000)

    def _pass(self, engine: sa.Engine, lease: Lease, report: PassReport) -> None:
        for _ in range(self.batches_per_pass):
            now = self._clock.now_ms()
            if not lease.acquire(now):
                return
            report.leased = True
            claimed, read = self._claim_batch(engine, now, report)
            if claimed:
                self._send(engine, claimed, report)
            if read < self.batch_rows:
                return
        report.more = True

    def _has_tables(self, engine: sa.Engine) -> bool:
        try:
            inspector = sa.inspect(engine)
            return inspector.has_table(self._table.name) and inspector.has_table(self._lease_table.name)
        except sa.exc.SQLAlchemyError:
            return True  # the database is unreachable, which the error already says

    def _claim_batch(self, engine: sa.Engine, now: int, report: PassReport) -> tuple[list[OutboxRow], int]:
        params = {"now": now, "cutoff": now - self.threshold_ms, "limit": self.batch_rows}
        claimed: list[OutboxRow] = []
        with engine.begin() as conn:
            rows = [to_row(r) for r in conn.execute(self._due, params).mappings()]
            for row in rows:
                hit = conn.execute(
                    self._claim, {"row_id": row.id, "seen_attempts": row.attempts, "claim_until": now + self.claim_ms}
                )
                if hit.rowcount == 1:
                    claimed.append(row)
                else:
                    report.claims_lost += 1
        return claimed, len(rows)

    def _send(self, engine: sa.Engine, rows: list[OutboxRow], report: PassReport) -> None:
        futures: dict[concurrent.futures.Future[None], OutboxRow] = {}
        errors: dict[int, str] = {}
        for row in rows:
            try:
                stored = StoredMessage(row.subject, row.message_id, row.content)
                futures[self._producer.send_async(stored, resend=True)] = row
            except Exception as exc:  # a full buffer, a closed producer, a row that is not a message
                errors[row.id] = f"{exc.__class__.__name__}: {exc}"
        done, not_done = concurrent.futures.wait(futures, timeout=self.send_wait_ms / 1000)
        sent: list[int] = []
        for fut in done:
            failure = fut.exception()
            if failure is None:
                sent.append(futures[fut].id)
            else:
                errors[futures[fut].id] = f"{failure.__class__.__name__}: {failure}"
        for fut in not_done:
            errors[futures[fut].id] = f"no answer from the broker within send_wait_ms={self.send_wait_ms}"
        now = self._clock.now_ms()
        with engine.begin() as conn:
            if sent:
                conn.execute(self._delete, {"ids": sent})
            if errors:
                failures = [self._failure(row, errors[row.id], now) for row in rows if row.id in errors]
                conn.execute(self._after_failure, failures)
        report.sent += len(sent)
        for row in rows:
            if row.id in errors:
                if row.attempts + 1 >= self.max_attempts:
                    report.blocked += 1
                    log.error(
                        "watchdog: outbox row %d (message %s to %r) blocked after %d attempts; last error: %s",
                        row.id,
                        row.message_id,
                        row.subject,
                        row.attempts + 1,
                        errors[row.id],
                    )
                else:
                    report.failed += 1

    def _failure(self, row: OutboxRow, error: str, now: int) -> dict[str, object]:
        attempts = row.attempts + 1
        blocked = attempts >= self.max_attempts
        backoff = min(self.backoff_ms_max, self.backoff_ms * 2 ** min(attempts - 1, 30))
        return {
            "row_id": row.id,
            "error": truncate_error(error),
            "next_attempt": now + backoff,
            "new_status": STATUS_BLOCKED if blocked else STATUS_PENDING,
        }

    def close(self) -> None:
        """Give up the leases this watchdog holds, so another one takes over without waiting."""
        for lease in self._leases:
            try:
                lease.release()
            except sa.exc.SQLAlchemyError as exc:
                log.warning("watchdog: could not give up the lease on %s: %s", lease.name, exc)


def list_blocked(
    engines: Sequence[sa.Engine], table: str = DEFAULT_OUTBOX_TABLE, limit: int = 1_000
) -> list[tuple[str, OutboxRow]]:
    """Blocked rows of every database as (database, row), oldest first, at most ``limit`` per database."""
    stmt = blocked_rows(outbox_table(check_table_name(table)))
    out: list[tuple[str, OutboxRow]] = []
    for engine in engines:
        with engine.connect() as conn:
            rows = conn.execute(stmt, {"limit": limit}).mappings()
            out.extend((engine.url.render_as_string(hide_password=True), to_row(r)) for r in rows)
    return out


def unblock(
    engines: Sequence[sa.Engine],
    table: str = DEFAULT_OUTBOX_TABLE,
    ids: list[int] | None = None,
    clock: Clock = SYSTEM_CLOCK,
) -> int:
    """Make blocked rows (all, or those of ``ids``) pending with no attempts, due now; how many changed."""
    stmt = unblock_rows(outbox_table(check_table_name(table)), ids)
    changed = 0
    for engine in engines:
        with engine.begin() as conn:
            changed += conn.execute(stmt, {"now": clock.now_ms()}).rowcount
    return changed
