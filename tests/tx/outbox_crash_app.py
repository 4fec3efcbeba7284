"""An application for the crash test: commits one order and its message, then stops inside the
after-commit hook, before the message reaches the producer, until the test kills it (kill -9).

    python outbox_crash_app.py DB_URL META_SERVER SUBJECT

Prints ``committed <message id>`` from the hook, then waits on its stdin forever.
"""

from __future__ import annotations

import concurrent.futures
import sys

import sqlalchemy as sa

from qmq.client.message import Message
from qmq.client.sync import Producer
from qmq.tx import TransactionalProducer


class StallBeforeSend:
    """Stands before the real producer: the commit has happened, the send never will."""

    def send_async(self, message: Message, *, resend: bool = False) -> concurrent.futures.Future[None]:
        print(f"committed {message.message_id}", flush=True)
        sys.stdin.read()  # blocks until the test kills this process
        raise AssertionError("stdin closed before the kill")


def main() -> None:
    db_url, meta_server, subject = sys.argv[1:4]
    engine = sa.create_engine(db_url)
    with Producer(app_code="crash-app", meta_server=meta_server):
        tx = TransactionalProducer(StallBeforeSend(), engine, create_table=True)
        with engine.begin() as conn:
            tx.send(conn, Message(subject, body="committed, then the process died"))


if __name__ == "__main__":
    main()
