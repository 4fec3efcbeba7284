"""The payment service: each payment row and its `payment.created` message commit in one transaction.

    python payment_service.py --db URL --meta-server URL --payments 10 [--crash-after-commit 3]

Creates payments 1..N (continuing after the last one already in the table, so a restart
picks up where a crash left off). ``--crash-after-commit K`` kills this process with
SIGKILL right after payment K's transaction commits and before its message is handed to
the producer: the message exists only as a row of the outbox table, which the watchdog
sends later.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import signal
import sys

import sqlalchemy as sa

from qmq import Producer
from qmq.client.message import Message
from qmq.tx import TransactionalProducer

SUBJECT = "payment.created"
metadata = sa.MetaData()
payments = sa.Table(
    "payments",
    metadata,
    sa.Column("id", sa.Integer, primary_key=True, autoincrement=False),
    sa.Column("amount_cents", sa.Integer, nullable=False),
)


class CrashBeforeSend:
    """Stands in front of the producer and kills the process at the K-th after-commit send."""

    def __init__(self, producer: Producer, crash_at_payment: int) -> None:
        self._producer = producer
        self._crash_at = crash_at_payment

    def send_async(self, message: Message, *, resend: bool = False) -> concurrent.futures.Future[None]:
        # The StoredMessage handed over carries only the encoded bytes; the payment id is in the message id.
        if message.message_id == payment_message_id(self._crash_at):
            print(f"payment-service: crashing after the commit of payment {self._crash_at}", flush=True)
            os.kill(os.getpid(), signal.SIGKILL)
        return self._producer.send_async(message, resend=resend)


def payment_message_id(payment_id: int) -> str:
    """A message id derived from the payment: a business key any resend keeps."""
    return f"payment-{payment_id}"


def amount_of(payment_id: int) -> int:
    return 1000 + 7 * payment_id


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--db", required=True, help="SQLAlchemy URL of the payment database")
    parser.add_argument("--meta-server", required=True, help="meta_server URL printed by `qmq ready`")
    parser.add_argument("--subject", default=SUBJECT, help=f"subject of the payment messages [{SUBJECT}]")
    parser.add_argument("--payments", type=int, default=10, help="payments there should be in the end")
    parser.add_argument("--crash-after-commit", type=int, default=0, metavar="K", help="die after payment K commits")
    args = parser.parse_args(argv)

    engine = sa.create_engine(args.db)
    metadata.create_all(engine)
    with Producer(app_code="payment-service", meta_server=args.meta_server) as producer:
        sender = CrashBeforeSend(producer, args.crash_after_commit) if args.crash_after_commit else producer
        with TransactionalProducer(sender, engine, create_table=True) as tx_producer:
            with engine.connect() as conn:
                done = conn.scalar(sa.select(sa.func.coalesce(sa.func.max(payments.c.id), 0))) or 0
            for payment_id in range(done + 1, args.payments + 1):
                msg = Message(args.subject, message_id=payment_message_id(payment_id))
                msg.set_property("paymentId", payment_id)
                msg.body = json.dumps({"payment_id": payment_id, "amount_cents": amount_of(payment_id)})
                with engine.begin() as conn:
                    conn.execute(payments.insert().values(id=payment_id, amount_cents=amount_of(payment_id)))
                    tx_producer.send(conn, msg)
                print(f"payment-service: payment {payment_id} committed", flush=True)
    engine.dispose()
    return 0


if __name__ == "__main__":
    sys.exit(main())
