"""The application is killed (kill -9) after its transaction committed and before the message
was sent: the outbox row survives and the watchdog delivers the message, once."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from outbox_helpers import consume, outbox_rows

from qmq.client.sync import Producer
from qmq.tx import Watchdog
from scratch_dbs import Database

pytestmark = pytest.mark.integration

_APP = Path(__file__).with_name("outbox_crash_app.py")
_LINE_TIMEOUT_S = 20.0


def _read_line(proc: subprocess.Popen[bytes], timeout_s: float) -> str:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0 or not select.select([fd], [], [], left)[0]:
            raise AssertionError(f"the application printed nothing within {timeout_s} s (got {buf!r})")
        chunk = os.read(fd, 4096)
        if not chunk:
            raise AssertionError(f"the application exited with {proc.wait()} before committing (got {buf!r})")
        buf += chunk
    return buf.split(b"\n", 1)[0].decode()


def test_killed_between_commit_and_send(server_db: Database, meta_server: str, subject: str) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(_APP), server_db.url, meta_server, subject],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
    )
    try:
        line = _read_line(proc, _LINE_TIMEOUT_S)
        assert line.startswith("committed "), line
        message_id = line.split()[1]
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(10) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                stream.close()

    engine = server_db.engine()
    try:
        assert outbox_rows(engine) == 1, "the committed row outlives the process"
        with Producer(app_code="tx-tests", meta_server=meta_server) as producer:
            dog = Watchdog(producer, engine, threshold_ms=0)
            [report] = dog.run_once()
            dog.close()
        assert (report.sent, report.error) == (1, None)
        assert outbox_rows(engine) == 0
        assert consume(meta_server, subject, 1) == [(message_id, b"committed, then the process died")]
    finally:
        engine.dispose()
