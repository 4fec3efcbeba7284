"""A REPLICATE that claims more than the master has releases no write: a client (hostile, or a
slave whose copy diverged) that names the group's real slave and offsets past the end of the
master's logs is refused, and a send waits for what the slave really wrote (here: never, the
slave is stopped, so the group turns read-only instead of acknowledging an unreplicated send)."""

from __future__ import annotations

import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import cluster_up, fast_config

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame, FrameDecoder, encode_frame
from qmq.protocol.message import encode_message

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def _call(address: str, code: int, header: dict[str, Any], body: bytes = b"") -> Frame:
    """One request on a connection of its own; its answer."""
    host, port = address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(encode_frame(Frame(code, 1, header, body)))
        decoder = FrameDecoder()
        while (frame := decoder.next_frame()) is None:
            data = sock.recv(65536)
            if not data:
                raise ConnectionError(f"{address} closed the connection")
            decoder.receive_data(data)
        return frame


def test_a_replicate_past_the_end_of_the_masters_logs_is_refused_and_releases_no_send(tmp_path: Path) -> None:
    args = ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        view = c.wait_view("the slave replicating", lambda v: any(s["replicated_ms"] for s in v["servers"]))
        [group] = view["groups"]
        [slave] = [s for s in view["servers"] if s["role_in_group"] == "slave"]
        os.kill(c.member("b1-s1").pid, signal.SIGSTOP)  # the real slave writes nothing more
        try:
            claim = {
                "from": 1 << 40,
                "action_from": 1 << 40,
                "epoch": group["epoch"],
                "max_bytes": 1024,
                "timeout_ms": 0,
                "slave": slave["address"],  # the name of a slave the meta server knows
            }
            refused = _call(group["master"], RequestCode.REPLICATE, claim)
            assert refused.status == Status.BAD_REQUEST, refused.header
            assert "past the end" in refused.header["error"]
            msg = encode_message(b"claims.s", b"m-1", b"", 0, b"", b"body", 1, 0)
            answer = _call(group["master"], RequestCode.SEND_MESSAGES, {}, msg)
            # before the fix the claimed offset counted as replicated: answered OK at once, on the
            # master's copy alone; now it waits for the slave and is refused once the group is read-only
            assert answer.status != Status.OK, answer.header
            assert "read-only" in str(answer.header), answer.header
        finally:
            os.kill(c.member("b1-s1").pid, signal.SIGCONT)
