"""40,000 subjects under an open-file limit of 1,024: sends, pulls, checkpoints and a restart
all work, since the broker keeps open files within a bound whatever the number of subjects."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from rawclient import RawClient, message, split_records

from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import decode_message
from qmq.store.checkpoint import read_checkpoint
from qmq.testing import ReadyProcess
from qmq.testing.processes import qmq_argv, start_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SUBJECTS = 40_000
FILE_LIMIT = 1024
SEND_BATCH = 1_000
PIPELINE = 500
PULLED = range(0, SUBJECTS, 4)  # a quarter, spread over all: each one's consume log was closed since


@contextmanager
def limited_broker(data: Path, log: Path) -> Iterator[ReadyProcess]:
    """A broker whose soft and hard open-file limits are both FILE_LIMIT (it raises its soft
    limit to the hard one at start), its stderr appended to ``log``."""
    argv = qmq_argv("broker", "--data-dir", str(data), "--checkpoint-interval-ms", "300")
    shell = f'exec prlimit --nofile={FILE_LIMIT}:{FILE_LIMIT} "$@" 2>>{log}'
    proc = start_ready(["bash", "-c", shell, "broker", *argv], env={"QMQ_LOG_LEVEL": "WARNING"})
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            assert proc.stop() == 0, log.read_text()[-3000:]
        if proc.proc.stdout is not None:
            proc.proc.stdout.close()


def open_files(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def send_all(client: RawClient, tag: str) -> None:
    for start in range(0, SUBJECTS, SEND_BATCH):
        batch = [message(f"many.{i}", f"{tag}-{i}") for i in range(start, start + SEND_BATCH)]
        resp = client.send(*batch)
        assert resp.status == Status.OK, resp.header
        assert answer_of(resp)["errors"] == [], answer_of(resp)["errors"][:3]


def pull_all(client: RawClient, group: str) -> dict[int, list[str]]:
    """The messages of the PULLED subjects for ``group``, with PIPELINE pulls in flight at once."""
    got: dict[int, list[str]] = {}
    for start in range(0, len(PULLED), PIPELINE):
        asked = {}
        for i in PULLED[start : start + PIPELINE]:
            header = {
                "subject": f"many.{i}",
                "group": group,
                "consumer_id": "c",
                "session": "s",
                "max": 10,
                "timeout_ms": 0,
                "start": "earliest",
            }
            asked[client.send_frame(RequestCode.PULL, header)] = i
        for _ in asked:
            frame = client.read_frame()
            assert frame.status == Status.OK, frame.header
            got[asked[frame.request_id]] = [decode_message(m).message_id for _s, m in split_records(bytes(frame.body))]
    return got


@pytest.mark.timeout(240)
def test_forty_thousand_subjects_under_a_limit_of_1024_open_files(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    log = tmp_path / "broker.log"
    with limited_broker(data, log) as proc:
        client = RawClient(proc.ready["address"], timeout_s=60)
        send_all(client, "first")
        assert open_files(proc.pid) < FILE_LIMIT // 2 + 100
        got = pull_all(client, "g")
        assert got == {i: [f"first-{i}"] for i in PULLED}
        assert open_files(proc.pid) < FILE_LIMIT // 2 + 100
        client.close()
    text = log.read_text()
    assert "Too many open files" not in text, text[-3000:]
    assert "checkpoint failed" not in text, text[-3000:]
    state = read_checkpoint(data)
    assert state is not None
    assert len(state["subjects"]) == SUBJECTS

    with limited_broker(data, log) as proc:  # the restart
        client = RawClient(proc.ready["address"], timeout_s=60)
        send_all(client, "second")
        got = pull_all(client, "g")  # what was pulled before and never acked comes again first
        assert got == {i: [f"first-{i}", f"second-{i}"] for i in PULLED}
        client.close()
    assert "Too many open files" not in log.read_text()
