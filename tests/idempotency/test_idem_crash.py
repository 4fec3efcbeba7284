"""A consumer killed (kill -9) after its transaction committed and before the ack: the broker
gives the message to the group again once the consumer is silent for ``consumer_offline_ms``,
another consumer of the group receives it, and the transactional checker does not apply it a
second time."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

import qmq
from qmq.client.sync import ReceivedMessage
from qmq.idempotency import TransactionalIdempotentChecker
from qmq.testing import ReadyProcess, running_standalone
from scratch_dbs import Database

pytestmark = pytest.mark.integration

_APP = Path(__file__).with_name("dedup_crash_app.py")
_LINE_TIMEOUT_S = 30.0
# A consumer silent this long loses its unacknowledged messages to its group's retry subject.
_OFFLINE_MS = 1_000
_REDELIVERY_TIMEOUT_S = 15.0  # about 2 s: consumer_offline_ms, its check, a retry pull
_GROUP = "payments"

_meta = sa.MetaData()
effects = sa.Table("effects", _meta, sa.Column("n", sa.Integer, primary_key=True), sa.Column("message_id", sa.Text))


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    data_dir = tmp_path_factory.mktemp("idem-crash") / "qmq-data"
    with running_standalone(data_dir, {"broker": {"consumer_offline_ms": _OFFLINE_MS}}) as proc:
        yield proc


def _first_line(proc: subprocess.Popen[bytes]) -> str:
    assert proc.stdout is not None
    deadline = time.monotonic() + _LINE_TIMEOUT_S
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([proc.stdout], [], [], left)[0]:
            raise AssertionError(f"the consumer printed nothing within {_LINE_TIMEOUT_S} s (got {buf!r})")
        chunk = os.read(proc.stdout.fileno(), 4096)
        if not chunk:
            raise AssertionError(f"the consumer exited with {proc.wait()} first (got {buf!r})")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def _commit_then_die(db: Database, meta_server: str, subject: str) -> str:
    """Run the crash app until it committed the message's effect, then kill -9 it; its output line."""
    argv = [sys.executable, str(_APP), db.url, meta_server, subject, _GROUP]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        line = _first_line(proc)
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
        return line
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()


def test_killed_after_commit_before_ack(server_db: Database, standalone: ReadyProcess) -> None:
    meta_server = standalone.meta_server
    subject = f"payments.{uuid.uuid4().hex[:12]}"
    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        sent = producer.generate_message(subject)
        producer.send(sent)
    assert _commit_then_die(server_db, meta_server, subject) == f"committed processed {sent.message_id} 1"

    # The broker, not the test, gives the message again: to another consumer of the group, once
    # the dead one was silent for consumer_offline_ms.
    engine = server_db.engine()
    try:
        deliveries: list[tuple[str, int]] = []
        came_again = threading.Event()

        def message_id(m: ReceivedMessage) -> str:
            # the checker's key function: called once per delivery, so it also counts them
            deliveries.append((m.message_id, m.times))
            came_again.set()
            return m.message_id

        applied: list[str] = []

        def apply_again(m: ReceivedMessage, conn: sa.Connection) -> None:
            applied.append(m.message_id)
            conn.execute(effects.insert().values(message_id=m.message_id))

        checker = TransactionalIdempotentChecker(engine, key=message_id, group=_GROUP)
        with qmq.Consumer(app_code="payments", meta_server=meta_server, consumer_id="survivor") as consumer:
            # The transactional checker calls handler(message, conn); the SDK types a one-argument handler.
            consumer.add_listener(subject, _GROUP, apply_again, idempotent_checker=checker)  # type: ignore[arg-type]
            assert came_again.wait(_REDELIVERY_TIMEOUT_S), "the broker never gave the message to the group again"
            consumer.flush_acks()
        assert deliveries == [(sent.message_id, 2)]
        assert applied == []
        with engine.connect() as conn:
            assert list(conn.execute(sa.select(effects.c.message_id)).scalars()) == [sent.message_id]
    finally:
        engine.dispose()
