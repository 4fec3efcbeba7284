"""A consumer killed (kill -9) after its transaction committed and before the ack: the message
comes again, and the transactional checker does not apply it a second time."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import sqlalchemy as sa

from qmq.client.message import Message
from qmq.idempotency import Outcome, TransactionalIdempotentChecker
from scratch_dbs import Database

_APP = Path(__file__).with_name("dedup_crash_app.py")
_LINE_TIMEOUT_S = 20.0


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


def test_killed_after_commit_before_ack(server_db: Database) -> None:
    message_id = f"payment-{uuid.uuid4().hex[:8]}"
    proc = subprocess.Popen(
        [sys.executable, str(_APP), server_db.url, message_id], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    try:
        assert _first_line(proc) == "committed processed"
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    # The redelivery of the same message, to another consumer of the group.
    engine = server_db.engine()
    try:
        applied: list[str] = []
        checker = TransactionalIdempotentChecker(engine)
        outcome = checker.run(Message("payments", message_id=message_id), lambda m, conn: applied.append("again"))
        assert outcome is Outcome.DUPLICATE
        assert applied == []
        with engine.connect() as conn:
            assert list(conn.execute(sa.text("SELECT message_id FROM effects")).scalars()) == [message_id]
    finally:
        engine.dispose()
