"""A consumer for the crash test: applies one message through the transactional checker, then
stops after the commit and before any acknowledgement, until the test kills it (kill -9).

    python dedup_crash_app.py DB_URL MESSAGE_ID

Prints ``committed <outcome>`` once the checker's transaction committed, then waits on stdin.
"""

from __future__ import annotations

import sys

import sqlalchemy as sa

from qmq.client.message import Message
from qmq.idempotency import TransactionalIdempotentChecker

metadata = sa.MetaData()
effects = sa.Table("effects", metadata, sa.Column("n", sa.Integer, primary_key=True), sa.Column("message_id", sa.Text))


def apply(message: Message, conn: sa.Connection) -> None:
    conn.execute(effects.insert().values(message_id=message.message_id))


def main() -> None:
    db_url, message_id = sys.argv[1:3]
    engine = sa.create_engine(db_url)
    metadata.create_all(engine)
    checker = TransactionalIdempotentChecker(engine)
    outcome = checker.run(Message("payments", message_id=message_id), apply)
    print(f"committed {outcome.value}", flush=True)
    sys.stdin.read()  # the ack would come next; the test kills this process first


if __name__ == "__main__":
    main()
