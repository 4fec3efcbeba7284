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


async def test_after_a_failed_fsync_pulls_and_acks_are_refused_busy_so_consumers_keep_their_acks(
    broker: BrokerServer,
) -> None:
    # refused before anything is written: retriable, so the consumer SDK keeps the acks for the
    # group's next master (its slave, which has the pulls they name) instead of dropping them
    # (fault campaign, failing disk: dropped acks were recorded as answered, then came again)
    assert _send(broker, "m1")[1] == Status.OK
    pull = {"subject": "s", "group": "g", "consumer_id": "c", "session": "s1", "max": 10, "start": "earliest"}
    conn = RecordingResponder()
    broker.dispatch(conn, Frame(RequestCode.PULL, 2, pull))
    broker.store._flush_failed(OSError(errno.EIO, "Input/output error"))
    for code, header in (
        (RequestCode.ACK, {"subject": "s", "group": "g", "consumer_id": "c", "ranges": [[0, 1]]}),
        (RequestCode.ACK_MANY, {"consumer_id": "c", "acks": [{"subject": "s", "group": "g", "ranges": [[0, 1]]}]}),
        (RequestCode.PULL, {**pull, "ack": [[0, 1]]}),
    ):
        conn = RecordingResponder()
        broker.dispatch(conn, Frame(code, 3, header))
        [(_code, _id, answer, status)] = conn.answers
        assert status == Status.BUSY, (code, answer)
        assert "stopped taking writes" in str(answer)
        assert "ask again" in str(answer)
