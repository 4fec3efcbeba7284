"""`qmq broker` with no checkpoint that checks out and an action log trimmed past it: it refuses
to start (exit 3, one line naming the file and the option) until told to accept the loss."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from qmq.common.config import BrokerConfig
from qmq.protocol.message import encode_message, scan_batch
from qmq.serving.runner import EXIT_STARTUP_FAILED
from qmq.store.broker_store import BrokerStore
from qmq.store.checkpoint import NAME, history
from qmq.testing import running_role
from qmq.testing.processes import qmq_argv

pytestmark = [pytest.mark.integration]


def damaged_data_dir(directory: Path) -> None:
    """A broker's data: a group that consumed with a checkpoint after each ack, action-log segments
    so small that the oldest were deleted, then every checkpoint damaged."""
    store = BrokerStore(BrokerConfig(data_dir=directory))
    store.open()
    store.alog.segments.segment_bytes = 256
    body = b"".join(encode_message(b"s", f"m{i}".encode(), b"", 0, b"", b"x", 1) for i in range(40))
    store.append(body, scan_batch(body))
    ticket = store.begin_flush()
    ticket.run()
    store.complete_flush(ticket)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    for _ in range(12):
        got = store.pull(gp, cp, "x", 2)
        assert got is not None
        store.ack(gp, cp, [[got.runs[0][0], got.runs[0][0] + 2]])
        state = store.checkpoint_state()
        store.write_checkpoint(store.begin_flush(consume_logs=True), state)
        store.after_checkpoint(state)
    assert store.alog.segments.start > 0
    store.close()
    for path in [directory / NAME, *history(directory)]:
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))


def test_the_broker_refuses_to_start_until_told_to_accept_the_loss(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    damaged_data_dir(data)
    args = ["broker", "--data-dir", str(data), "--port", "0", "--http-port", "0"]
    refused = subprocess.run(qmq_argv(*args), capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    assert refused.returncode == EXIT_STARTUP_FAILED
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1, refused.stderr
    assert lines[0].startswith("qmq broker: cannot start: ")
    assert f"checkpoint {data / NAME} is damaged" in lines[0]
    assert "--accept-progress-loss" in lines[0]

    with running_role([*args, "--accept-progress-loss"]) as proc:
        assert proc.ready["address"]


def test_the_option_is_listed_in_the_brokers_help() -> None:
    shown = subprocess.run(qmq_argv("broker", "--help"), capture_output=True, text=True, timeout=60, check=True)
    assert "--accept-progress-loss" in shown.stdout
