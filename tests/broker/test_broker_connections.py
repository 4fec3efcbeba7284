"""What one client can cost a broker through its connections: a client that never reads its
replies holds a bounded amount of the broker's memory, and idle connections past
connections_max neither lock real clients out for good nor leave them guessing why."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from rawclient import RawClient, message

from qmq.common.limits import MiB
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.testing import ReadyProcess, metric_value, running_role, running_standalone, write_config

pytestmark = pytest.mark.integration

_BIG_BODY_BYTES = 3_900_000  # two fit one READ answer (pull_bytes_max 8 MiB): ~7.8 MB per answer
_READS = 300  # 2.3 GiB of answers if the broker wrote them all into its buffers
# With flow control the stalled connection holds about one answer (7.8 MB) past its write
# buffer's 64 KiB high-water mark (7.4 MiB of growth measured); 32 MiB leaves four times that for
# the allocator, and stays under reply_backlog_bytes_max (64 MiB), the hard cap. Before the fix
# the broker answered all 300 and grew by 2.2 GiB.
_RSS_GROWTH_BYTES_MAX = 32 * MiB
_PING_S_MAX = 1.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS in /proc/{pid}/status")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[ReadyProcess]:
    args = ["broker", "--data-dir", str(tmp_path / "broker"), "--port", "0", "--http-port", "0"]
    with running_role(args) as proc:
        yield proc


def test_a_client_that_never_reads_its_replies_holds_bounded_memory(broker: ReadyProcess, subject: str) -> None:
    address = broker.ready["address"]
    other = RawClient(address)
    for i in range(2):
        assert other.send(message(subject, f"big-{i}", os.urandom(_BIG_BODY_BYTES))).status == Status.OK
    assert other.call(RequestCode.READ, {"subject": subject, "from": 0, "max": 2}).header["count"] == 2
    idle_rss = rss_bytes(broker.pid)
    host, port = address.rsplit(":", 1)
    hog = socket.create_connection((host, int(port)))
    try:
        read = {"subject": subject, "from": 0, "max": 2}
        hog.sendall(b"".join(encode_frame(Frame(RequestCode.READ, i, read)) for i in range(1, _READS + 1)))
        peak_rss = idle_rss
        deadline = time.monotonic() + 3.0
        while time.monotonic() < deadline:
            started = time.monotonic()
            assert other.call(RequestCode.PING).status == Status.OK
            assert time.monotonic() - started < _PING_S_MAX, "another client waited for the stalled one"
            peak_rss = max(peak_rss, rss_bytes(broker.pid))
            time.sleep(0.05)
        reads = metric_value(broker.ready["http"], "qmq_requests_total", command="READ")
        growth = peak_rss - idle_rss
        assert growth < _RSS_GROWTH_BYTES_MAX, (
            f"the broker grew {growth / MiB:.0f} MiB for a client that reads nothing ({reads:.0f} READs answered)"
        )
        # the stalled client's answers wait until it reads them; it gets them, in order
        hog.settimeout(30)
        decoder = FrameDecoder()
        got: list[int] = []
        while len(got) < 10:
            data = hog.recv(1 << 20)
            assert data, f"the broker closed the connection after {len(got)} answers"
            decoder.receive_data(data)
            while (frame := decoder.next_frame()) is not None:
                assert frame.status == Status.OK, frame.header
                got.append(frame.request_id)
        assert got[:10] == list(range(1, 11))
    finally:
        hog.close()
        other.close()


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=60)


def wait_for(what: str, check: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)


def closing_words(sock: socket.socket) -> Frame:
    """The error frame a server sends before it closes ``sock``, and its close."""
    sock.settimeout(10)
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    decoder = FrameDecoder()
    decoder.receive_data(data)
    frame = decoder.next_frame()
    assert frame is not None, "the server closed the connection without a word"
    return frame


def test_connections_past_connections_max_are_told_why_and_silent_ones_time_out(tmp_path: Path, subject: str) -> None:
    config = {"broker": {"connections_max": 5, "first_request_timeout_ms": 1000}}
    with running_standalone(tmp_path / "qmq-data", config) as standalone:
        address, http = standalone.ready["broker"], standalone.ready["broker_http"]
        meta = standalone.meta_server
        others = int(metric_value(http, "qmq_connections"))  # the delay server's, ready to hand over
        # clients that sent a request once and went quiet keep their connections: the rest of the 5
        quiet = [RawClient(address) for _ in range(5 - others)]
        for c in quiet:
            assert c.call(RequestCode.PING).status == Status.OK
        assert metric_value(http, "qmq_connections") == 5
        sent = qmq("send", subject, "--body", "x", "--meta-server", meta)
        assert sent.returncode != 0
        assert "connections_max 5" in sent.stderr, sent.stderr
        assert "raise connections_max (--connections-max" in sent.stderr, sent.stderr
        assert metric_value(http, "qmq_connections_refused_total", reason="connections_max") >= 1
        # two of them leave; two connections that never send a request take their places
        for c in quiet[:2]:
            c.close()
        wait_for("two connections closed", lambda: metric_value(http, "qmq_connections") == 3, 10)
        host, port = address.rsplit(":", 1)
        silent = [socket.create_connection((host, int(port))) for _ in range(2)]
        try:
            for sock in silent:
                bye = closing_words(sock)  # after first_request_timeout_ms
                assert bye.request_id == 0
                assert "no request within first_request_timeout_ms 1000 ms" in bye.header["error"]
        finally:
            for sock in silent:
                sock.close()
        assert metric_value(http, "qmq_connections_dropped_total", reason="no_request") == 2
        for c in quiet[2:]:
            assert c.call(RequestCode.PING).status == Status.OK  # quiet for seconds, still open
        sent = qmq("send", subject, "--body", "x", "--meta-server", meta)
        assert sent.returncode == 0, sent.stderr
        for c in quiet[2:]:
            c.close()


def _from(host: str, address: str) -> socket.socket:
    """A connection to ``address`` from the local address ``host`` (any of 127.0.0.0/8 is this machine)."""
    to_host, port = address.rsplit(":", 1)
    return socket.create_connection((to_host, int(port)), timeout=10, source_address=(host, 0))


def _ping(sock: socket.socket) -> Frame:
    sock.sendall(encode_frame(Frame(RequestCode.PING, 1)))
    decoder = FrameDecoder()
    while (frame := decoder.next_frame()) is None:
        data = sock.recv(65536)
        assert data, "the broker closed the connection"
        decoder.receive_data(data)
    return frame


def test_one_host_holds_at_most_connections_per_host_max_and_others_still_connect(tmp_path: Path) -> None:
    # Found by the fault campaign's hostile-clients scenario: one client's 5,000 idle connections
    # took all of connections_max (4,096), and a new connection of any other client was refused.
    config = write_config(tmp_path / "broker.toml", {"broker": {"connections_max": 10, "connections_per_host_max": 3}})
    args = ["broker", "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0", "--config", str(config)]
    with running_role(args) as broker:
        address, http = broker.ready["address"], broker.ready["http"]
        hog = [_from("127.0.0.2", address) for _ in range(3)]
        others: list[socket.socket] = []
        try:
            for sock in hog:
                assert _ping(sock).status == Status.OK  # idle from now on
            refused = _from("127.0.0.2", address)
            bye = closing_words(refused)
            refused.close()
            assert bye.status == Status.BUSY
            assert "connections_per_host_max 3 client connections open from 127.0.0.2" in bye.header["error"]
            assert "raise connections_per_host_max (--connections-per-host-max" in bye.header["error"]
            assert metric_value(http, "qmq_connections_refused_total", reason="connections_per_host_max") == 1
            # the other hosts' share of connections_max is theirs
            others = [_from(host, address) for host in ("127.0.0.1", "127.0.0.3", "127.0.0.3")]
            for sock in others:
                assert _ping(sock).status == Status.OK
            # one of the host's connections closes: it may open one again
            hog.pop().close()
            wait_for("the closed connection forgotten", lambda: metric_value(http, "qmq_connections") == 5, 10)
            hog.append(_from("127.0.0.2", address))
            assert _ping(hog[-1]).status == Status.OK
        finally:
            for sock in hog + others:
                sock.close()
