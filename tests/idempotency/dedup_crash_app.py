"""A consumer for the crash test: pulls one message of a consumer group from a real broker,
applies it through the transactional checker, then stops after the commit and before any
acknowledgement, until the test kills it (kill -9).

    python dedup_crash_app.py DB_URL META_SERVER SUBJECT GROUP

Prints ``committed <outcome> <message id> <attempt>`` once the checker's transaction
committed, then waits on stdin.
"""

from __future__ import annotations

import sys
import time

import sqlalchemy as sa

import qmq
from qmq.client.sync import ReceivedMessage
from qmq.idempotency import TransactionalIdempotentChecker

_PULL_TIMEOUT_S = 30.0

metadata = sa.MetaData()
effects = sa.Table("effects", metadata, sa.Column("n", sa.Integer, primary_key=True), sa.Column("message_id", sa.Text))


def apply(message: ReceivedMessage, conn: sa.Connection) -> None:
    conn.execute(effects.insert().values(message_id=message.message_id))


def main() -> None:
    db_url, meta_server, subject, group = sys.argv[1:5]
    engine = sa.create_engine(db_url)
    metadata.create_all(engine)
    checker = TransactionalIdempotentChecker(engine, group=group)
    with qmq.Consumer(app_code="payments", meta_server=meta_server, consumer_id="crash-app") as consumer:
        pull = consumer.pull_consumer(subject, group, start_from="earliest")
        deadline = time.monotonic() + _PULL_TIMEOUT_S
        batch = pull.pull(max_messages=1, timeout_ms=1_000)
        while not len(batch):
            if time.monotonic() > deadline:
                raise SystemExit(f"no message of {subject!r} came within {_PULL_TIMEOUT_S} s")
            batch = pull.pull(max_messages=1, timeout_ms=1_000)
        [message] = batch
        outcome = checker.run(message, apply)
        print(f"committed {outcome.value} {message.message_id} {message.times}", flush=True)
        sys.stdin.read()  # the ack would come next; the test kills this process first


if __name__ == "__main__":
    main()
