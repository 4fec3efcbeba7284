"""The acks a pull carries (acks_with_pulls) are put back when the broker refuses that pull, so a
later request sends them: a broker whose store failed refuses a pull BUSY, and the acks then
go to the group's next master (found by the fault campaign, failing disk: they were dropped,
never answered, and the messages came again)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from qmq.client.meta import BrokerGroup
from qmq.client.options import ConnectOptions, ConsumerOptions
from qmq.client.puller import ConsumerContext, SubjectPuller
from qmq.client.received import Batch, ReceivedMessage
from qmq.common.errors import BrokerError
from qmq.protocol.codes import Status


class _RefusingConnection:
    """Answers every request with the error it was given; keeps the headers it was sent."""

    def __init__(self, error: BaseException) -> None:
        self.error = error
        self.headers: list[dict[str, Any]] = []

    async def start_request(self, code: int, header: dict[str, Any], with_session: bool = False) -> asyncio.Future[Any]:
        self.headers.append(header)
        fut: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        fut.set_exception(self.error)
        return fut


class _Pool:
    def __init__(self, conn: _RefusingConnection) -> None:
        self.conn = conn

    def get(self, address: str) -> _RefusingConnection:
        return self.conn


async def _no_nack(_m: Any, _exc: BaseException | None) -> None:
    return None


@pytest.mark.parametrize(
    "error",
    [
        BrokerError(Status.BUSY, "BUSY", "the broker's store stopped taking writes; ask again", retriable=True),
        BrokerError(Status.NOT_MASTER, "NOT_MASTER", "no longer master", retriable=True),
    ],
)
async def test_the_acks_a_refused_pull_carried_are_put_back(error: BrokerError) -> None:
    conn = _RefusingConnection(error)
    ctx = ConsumerContext(
        "app",
        "c1",
        ConsumerOptions(),
        ConnectOptions(),
        _no_nack,
        meta=object(),
        pool=_Pool(conn),  # type: ignore[arg-type]
    )
    puller = SubjectPuller(ctx, "s", "g", "earliest", "s", ReceivedMessage, Batch)
    bg = BrokerGroup("b1", "127.0.0.1:1")
    tracker = puller._tracker(bg.name)
    tracker.ack(0)
    tracker.ack(1)
    with pytest.raises(BrokerError):
        await puller._pull_one(bg, 10, 0)
    assert conn.headers[0]["ack"] == [[0, 2]]  # the pull carried them
    assert tracker.pending  # and they wait for the next request
    assert tracker.take() == [[0, 2]]
