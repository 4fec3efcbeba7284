"""The ledger service: applies each `payment.created` message once, whatever is redelivered.

    python ledger_service.py --db URL --meta-server URL --expect 10 [--crash-after-commit 5]

Each message is applied by a ``TransactionalIdempotentChecker``: the ledger entry, the
balance update and the "processed" record commit in one transaction, so a message that
comes again (its ack was lost when this process died) is recognised and skipped.
``--crash-after-commit K`` kills this process with SIGKILL right after the K-th payment's
transaction commits and before the message is acknowledged. It exits 0 once the ledger
holds ``--expect`` entries and every message is acknowledged.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time

import sqlalchemy as sa

from qmq import Consumer
from qmq.client.sync import ReceivedMessage
from qmq.idempotency import Outcome, TransactionalIdempotentChecker

SUBJECT = "payment.created"
GROUP = "ledger"
# The same consumer id after a restart: the broker hands it again what it never acknowledged.
CONSUMER_ID = "ledger-1"
_DEADLINE_S = 60.0

metadata = sa.MetaData()
# No unique constraint on payment_id on purpose: a payment applied twice would show.
ledger = sa.Table(
    "ledger",
    metadata,
    sa.Column("entry", sa.Integer, primary_key=True, autoincrement=True),
    sa.Column("payment_id", sa.Integer, nullable=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
)
balance = sa.Table(
    "balance",
    metadata,
    sa.Column("account", sa.String(20), primary_key=True),
    sa.Column("cents", sa.BigInteger, nullable=False),
)


def apply_payment(message: ReceivedMessage, conn: sa.Connection) -> None:
    """The business effect: one ledger entry and the balance moved, in the checker's transaction."""
    data = json.loads(message.body)
    conn.execute(ledger.insert().values(payment_id=data["payment_id"], amount_cents=data["amount_cents"]))
    conn.execute(balance.update().values(cents=balance.c.cents + data["amount_cents"]))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the ledger database")
    parser.add_argument("--meta-server", required=True, help="meta_server URL printed by `qmq ready`")
    parser.add_argument("--subject", default=SUBJECT, help=f"subject of the payment messages [{SUBJECT}]")
    parser.add_argument("--expect", type=int, required=True, help="stop once the ledger has this many entries")
    parser.add_argument("--crash-after-commit", type=int, default=0, metavar="K", help="die after payment K commits")
    args = parser.parse_args(argv)

    engine = sa.create_engine(args.db)
    metadata.create_all(engine)
    with engine.begin() as conn:
        if conn.scalar(sa.select(sa.func.count()).select_from(balance)) == 0:
            conn.execute(balance.insert().values(account="main", cents=0))
    checker = TransactionalIdempotentChecker(engine, group=GROUP)
    deadline = time.monotonic() + _DEADLINE_S
    with Consumer(app_code="ledger-service", meta_server=args.meta_server, consumer_id=CONSUMER_ID) as consumer:
        pull = consumer.pull_consumer(args.subject, GROUP, start_from="earliest")
        while True:
            with engine.connect() as conn:
                entries = conn.scalar(sa.select(sa.func.count()).select_from(ledger))
            if entries is not None and entries >= args.expect:
                break
            if time.monotonic() > deadline:
                print(f"ledger-service: only {entries} of {args.expect} entries after {_DEADLINE_S} s", flush=True)
                return 1
            for m in pull.pull(max_messages=100, timeout_ms=1000):
                outcome = checker.run(m, apply_payment)
                payment_id = json.loads(m.body)["payment_id"]
                print(f"ledger-service: payment {payment_id} {outcome.value} (delivery {m.times})", flush=True)
                if outcome is Outcome.PROCESSED and payment_id == args.crash_after_commit:
                    print(f"ledger-service: crashing after payment {payment_id} committed, before its ack", flush=True)
                    os.kill(os.getpid(), signal.SIGKILL)
                m.ack()
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
