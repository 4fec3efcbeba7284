"""The broker's silent-consumer check forgets consumers gone with nothing unacknowledged: a
consumer restarted 1,000 times with fresh ids leaves nothing behind once they are gone long
enough. Built in process, on a manual clock (consumer_forget_ms is at least two minutes)."""

from __future__ import annotations

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

FORGET_MS = 120_000


@pytest.fixture
async def broker(tmp_path: Path) -> AsyncIterator[BrokerServer]:
    config = BrokerConfig(
        data_dir=tmp_path / "broker", flush="periodic", consumer_offline_ms=1000, consumer_forget_ms=FORGET_MS
    )
    server = BrokerServer(config, ManualClock())
    server.store.open()
    yield server
    server.store.close()
    server.flusher.executor.shutdown()
    server.checkpoint_executor.shutdown()


def pull(server: BrokerServer, consumer_id: str, ack: list[list[int]] | None = None) -> dict[str, object]:
    conn = RecordingResponder()
    header = {"subject": "s", "group": "g", "consumer_id": consumer_id, "session": "x", "max": 10, "start": "earliest"}
    server.dispatch(conn, Frame(RequestCode.PULL, 1, {**header, **({"ack": ack} if ack else {})}))
    [(_code, _id, answer, status)] = conn.answers
    assert status == Status.OK, answer
    assert answer is not None
    return answer


def consumers(server: BrokerServer) -> list[str]:
    conn = RecordingResponder()
    server.dispatch(conn, Frame(RequestCode.LAG, 1, {"subject": "s", "group": "g"}))
    [(_code, _id, answer, _status)] = conn.answers
    assert answer is not None
    return [c["consumer_id"] for c in answer["consumers"]]


async def test_consumers_gone_with_nothing_unacked_are_forgotten_by_the_silent_check(broker: BrokerServer) -> None:
    clock = broker.clock
    assert isinstance(clock, ManualClock)
    conn = RecordingResponder()
    broker.dispatch(conn, Frame(RequestCode.SEND_MESSAGES, 1, {}, message("s", "m1")))
    for restart in range(1000):
        pull(broker, f"restart-{restart}")  # the first one takes m1 and never acks it
    clock.advance(FORGET_MS / 1000 - 1)
    assert pull(broker, "alive")["runs"] == []
    await broker._expire_silent()
    assert len(consumers(broker)) == 1001  # not gone long enough
    clock.advance(1)
    await broker._expire_silent()
    # restart-0's unacked message went to retry (consumer_offline_ms) and it is forgotten too
    assert consumers(broker) == ["alive"]
    broker.role = "slave"  # a slave forgets only what its master's action log says
    clock.advance(FORGET_MS / 1000)
    await broker._expire_silent()
    assert consumers(broker) == ["alive"]


async def test_a_slave_moves_nothing_to_retry_on_its_own(broker: BrokerServer) -> None:
    # its copy must change only by what its master sends, or it would differ from the master's
    clock = broker.clock
    assert isinstance(clock, ManualClock)
    broker.dispatch(RecordingResponder(), Frame(RequestCode.SEND_MESSAGES, 1, {}, message("s", "m1")))
    pull(broker, "silent")  # takes m1, never acks it
    end = broker.store.mlog.end
    broker.role = "slave"
    clock.advance(10)  # far past consumer_offline_ms
    await broker._expire_silent()
    assert broker.store.mlog.end == end
    assert not any(name.startswith("%RETRY%") for name in broker.store.subjects)
    broker.role = "master"
    await broker._expire_silent()
    assert broker.store.mlog.end > end  # the master does move it
