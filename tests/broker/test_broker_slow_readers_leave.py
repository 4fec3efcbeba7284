"""Clients that pipeline many requests, never read the answers and then go away cost the broker
nothing once gone: the requests they left decoded but unhandled are dropped with them, and
other clients are answered at once.

Found by the fault campaign's hostile-clients scenario: 100 such clients (2,000 READs each)
closed their sockets, and the broker then handled every READ they had left, for minutes, on
its event loop, answering nobody else: its heartbeats stopped, the meta server marked the
group unavailable, and sends and delay hand-overs went unanswered."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from rawclient import RawClient, message

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, encode_frame
from qmq.testing import ReadyProcess, metric_value, running_role

pytestmark = pytest.mark.integration

_MESSAGES = 2_000
_BODY_BYTES = 200
_READERS = 100
_READS_EACH = 2_000  # every READ asks for 1,000 messages: seconds of work each reader leaves behind
_PING_S_MAX = 1.0
_READS_HANDLED_EACH_MAX = 50


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ReadyProcess]:
    args = ["broker", "--data-dir", str(tmp_path / "broker"), "--port", "0", "--http-port", "0"]
    with running_role(args) as proc:
        yield proc


def test_requests_left_by_clients_that_went_away_are_not_handled(broker: ReadyProcess, subject: str) -> None:
    address = broker.ready["address"]
    other = RawClient(address)
    try:
        batch = [message(subject, f"m-{i}", b"x" * _BODY_BYTES) for i in range(_MESSAGES)]
        for i in range(0, _MESSAGES, 500):
            assert other.send(*batch[i : i + 500]).status == Status.OK
        host, port = address.rsplit(":", 1)
        read = {"subject": subject, "from": 0, "max": 1000}
        frames = b"".join(encode_frame(Frame(RequestCode.READ, i, read)) for i in range(1, _READS_EACH + 1))
        readers = []
        for _ in range(_READERS):
            sock = socket.create_connection((host, int(port)))
            sock.setblocking(False)
            with contextlib.suppress(BlockingIOError):
                sock.send(frames)  # as much as the socket takes; the answers are never read
            readers.append(sock)
        assert other.call(RequestCode.PING).status == Status.OK  # the broker has taken the requests in
        for sock in readers:
            sock.close()  # unread answers: the kernel resets these connections
        deadline = time.monotonic() + 5.0
        slowest = 0.0
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert other.call(RequestCode.PING).status == Status.OK
            slowest = max(slowest, time.monotonic() - started)
            assert slowest < _PING_S_MAX, f"a PING took {slowest:.1f} s after the slow readers left"
            time.sleep(0.05)  # PINGs for a few seconds: the broker must answer each at once
        # each reader had its READs handled until its answers filled the socket buffers (a few
        # dozen); before the fix the broker went on through the 2,000 each had left once it was
        # gone (34,000 to 108,000 READs measured, for nobody)
        reads = metric_value(broker.ready["http"], "qmq_requests_total", command="READ")
        assert reads < _READERS * _READS_HANDLED_EACH_MAX, f"{reads:.0f} READs handled"
    finally:
        other.close()
