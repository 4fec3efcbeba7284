"""The whole story, with a crash on each side, ending with every payment applied exactly once.

    python scenario.py [--payments-db URL] [--ledger-db URL] [--meta-server URL] [--payments 10]

Without ``--meta-server`` it starts a ``qmq standalone`` of its own (data in a temporary
directory); without database URLs it uses SQLite files in a temporary directory.

1. The payment service creates the payments and dies (SIGKILL) right after payment 3
   commits, before that payment's message is sent; it is restarted and finishes.
2. The watchdog finds payment 3's outbox row and sends it.
3. The ledger service applies payments and dies right after payment 5's transaction
   commits, before its acknowledgement; it is restarted, receives again what it never
   acknowledged, and skips what it had applied.
4. Check: N payments, N ledger entries, each payment once, the balance their sum.
"""

from __future__ import annotations

import argparse
import signal
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa

from qmq import Producer
from qmq.tx import Watchdog

HERE = Path(__file__).resolve().parent
_STEP_TIMEOUT_S = 90.0


@dataclass(frozen=True)
class Outcome:
    payments: int
    ledger_entries: int
    distinct_payments_in_ledger: int
    balance_cents: int
    expected_balance_cents: int
    outbox_rows_left: int

    @property
    def exactly_once(self) -> bool:
        return (
            self.ledger_entries == self.payments == self.distinct_payments_in_ledger
            and self.balance_cents == self.expected_balance_cents
            and self.outbox_rows_left == 0
        )


def _service(script: str, *args: str, expect_crash: bool) -> None:
    proc = subprocess.run(
        [sys.executable, str(HERE / script), *args], timeout=_STEP_TIMEOUT_S, stdout=subprocess.PIPE, text=True
    )
    sys.stdout.write(proc.stdout)
    expected = -signal.SIGKILL if expect_crash else 0
    if proc.returncode != expected:
        raise RuntimeError(f"{script} exited with {proc.returncode}, expected {expected}")


def run(
    payments_db: str, ledger_db: str, meta_server: str, payments: int = 10, subject: str = "payment.created"
) -> Outcome:
    """Run the four steps against a running qmq and two databases; what the databases hold at the end."""
    producer_crash, consumer_crash = 3, 5
    common = ["--meta-server", meta_server, "--subject", subject]
    print(f"-- 1. payment service, crashing after payment {producer_crash} commits", flush=True)
    _service(
        "payment_service.py",
        "--db",
        payments_db,
        *common,
        "--payments",
        str(payments),
        "--crash-after-commit",
        str(producer_crash),
        expect_crash=True,
    )
    _service("payment_service.py", "--db", payments_db, *common, "--payments", str(payments), expect_crash=False)

    print("-- 2. watchdog: send what was committed but never sent", flush=True)
    engine = sa.create_engine(payments_db)
    with Producer(app_code="watchdog", meta_server=meta_server) as producer:
        dog = Watchdog(producer, engine, threshold_ms=0)
        for report in dog.run_once():
            # Besides payment 3: rows of messages sent before the crash whose deletion it cut
            # short. The broker's duplicate window drops those repeats.
            print(f"watchdog: resent {report.sent} outbox row(s), {report.failed} failed", flush=True)
        dog.close()

    print(f"-- 3. ledger service, crashing after payment {consumer_crash} commits, before its ack", flush=True)
    ledger_args = ["--db", ledger_db, *common, "--expect", str(payments)]
    _service("ledger_service.py", *ledger_args, "--crash-after-commit", str(consumer_crash), expect_crash=True)
    _service("ledger_service.py", *ledger_args, expect_crash=False)

    print("-- 4. check", flush=True)
    ledger_engine = sa.create_engine(ledger_db)
    try:
        with engine.connect() as conn:
            n_payments = conn.scalar(sa.text("SELECT COUNT(*) FROM payments")) or 0
            expected = conn.scalar(sa.text("SELECT SUM(amount_cents) FROM payments")) or 0
            outbox = conn.scalar(sa.text("SELECT COUNT(*) FROM qmq_msg_queue")) or 0
        with ledger_engine.connect() as conn:
            entries = conn.scalar(sa.text("SELECT COUNT(*) FROM ledger")) or 0
            distinct = conn.scalar(sa.text("SELECT COUNT(DISTINCT payment_id) FROM ledger")) or 0
            cents = conn.scalar(sa.text("SELECT cents FROM balance")) or 0
    finally:
        engine.dispose()
        ledger_engine.dispose()
    outcome = Outcome(n_payments, entries, distinct, int(cents), int(expected), outbox)
    print(
        f"payments {outcome.payments}, ledger entries {outcome.ledger_entries} "
        f"({outcome.distinct_payments_in_ledger} distinct), balance {outcome.balance_cents} "
        f"(expected {outcome.expected_balance_cents}), outbox rows left {outcome.outbox_rows_left}: "
        + ("EXACTLY ONCE" if outcome.exactly_once else "NOT exactly once"),
        flush=True,
    )
    return outcome


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--payments-db", help="SQLAlchemy URL of the payment database (default: SQLite file)")
    parser.add_argument("--ledger-db", help="SQLAlchemy URL of the ledger database (default: SQLite file)")
    parser.add_argument("--meta-server", help="meta_server URL of a running qmq (default: start one)")
    parser.add_argument("--payments", type=int, default=10)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="qmq-exactly-once-") as tmp:
        payments_db = args.payments_db or f"sqlite:///{tmp}/payments.db"
        ledger_db = args.ledger_db or f"sqlite:///{tmp}/ledger.db"
        if args.meta_server:
            return 0 if run(payments_db, ledger_db, args.meta_server, args.payments).exactly_once else 1
        from qmq.testing import running_standalone

        with running_standalone(Path(tmp) / "qmq-data") as qmq:
            print(f"-- qmq standalone at {qmq.meta_server}", flush=True)
            return 0 if run(payments_db, ledger_db, qmq.meta_server, args.payments).exactly_once else 1


if __name__ == "__main__":
    sys.exit(main())
