"""A store that can no longer tell what is durable (a failed fsync) refuses every send until a
restart, and says so in the send's answer, in /health (503) and in its heartbeat's write state."""

from __future__ import annotations

import errno
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from rawclient import message

from qmq.broker.server import BrokerServer
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from recording import RecordingResponder


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[BrokerServer]:
    server = BrokerServer(BrokerConfig(data_dir=tmp_path / "broker", flush="periodic"), ManualClock())
    server.store.open()
    yield server
    server.store.close()
    server.flusher.executor.shutdown()
    server.checkpoint_executor.shutdown()


def _send(server: BrokerServer, mid: str) -> tuple[object, int]:
    conn = RecordingResponder()
    server.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 1, {}, message("s", mid)))
    [(_code, _id, answer, status)] = conn.answers
    return answer, status


async def test_after_a_failed_fsync_sends_are_refused_and_health_says_restart(broker: BrokerServer) -> None:
    assert _send(broker, "m1")[1] == Status.OK
    assert broker.health()["ok"]
    assert broker.write_state() == "ok"
    broker.store._flush_failed(OSError(errno.EIO, "Input/output error"))  # what the group commit calls
    answer, status = _send(broker, "m2")
    assert status == Status.BUSY  # retriable: producers and delay servers send to another group
    assert "until it is restarted" in str(answer)
    health = broker.health()
    assert health["ok"] is False
    assert "restart the broker" in str(health["error"])
    assert broker.write_state() == "failed"
    assert broker._heartbeat()["write_state"] == "failed"
    assert b"\nqmq_store_failed 1.0\n" in broker.metrics.render()
