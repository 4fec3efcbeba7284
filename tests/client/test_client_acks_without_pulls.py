"""A consumer made with acks_with_pulls=False (the HTTP gateway's): acks never ride on a pull,
so a flush_acks that returned has delivered every ack made before it; against a real broker."""

from __future__ import annotations

import pytest

from qmq.aio import Consumer, Message, Producer, PullConsumer, ReceivedMessage

pytestmark = [pytest.mark.integration]


async def _send(meta_server: str, subject: str, n: int) -> None:
    async with Producer(app_code="test", meta_server=meta_server) as producer:
        for i in range(n):
            await producer.send(Message(subject, body=f"m{i}".encode()))


async def _pull(pc: PullConsumer, n: int) -> list[ReceivedMessage]:
    """Pull until ``n`` messages came (or 50 pulls of 200 ms went by)."""
    got: list[ReceivedMessage] = []
    for _ in range(50):
        got += await pc.pull(10, 200)
        if len(got) >= n:
            break
    return got


@pytest.mark.parametrize("with_pulls", [True, False])
async def test_acks_go_with_pulls_only_when_asked(meta_server: str, subject: str, with_pulls: bool) -> None:
    await _send(meta_server, subject, 3)
    async with Consumer(
        app_code="test", meta_server=meta_server, acks_with_pulls=with_pulls, ack_flush_ms=60_000
    ) as consumer:
        pc = consumer.pull_consumer(subject, "g", "earliest")
        got = await _pull(pc, 3)
        for m in got:
            m.ack()
        assert consumer.acks_pending
        await pc.pull(10, 0)  # nothing left to pull; a pull would carry the acks
        assert consumer.acks_pending is not with_pulls
        await consumer.flush_acks()
        assert not consumer.acks_pending
        assert not consumer.acks_undelivered


async def test_acks_with_pulls_must_be_a_bool(meta_server: str) -> None:
    from qmq.common.errors import ConfigError

    with pytest.raises(ConfigError, match="acks_with_pulls"):
        Consumer(app_code="test", meta_server=meta_server, acks_with_pulls="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("with_pulls", [True, False])
async def test_acks_the_broker_never_handed_out_are_counted_and_logged(
    meta_server: str, subject: str, with_pulls: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # what a consumer's acks of a pull from a master since replaced look like to the new master:
    # positions past its pull log (forged here), which acknowledge nothing
    await _send(meta_server, subject, 2)
    async with Consumer(
        app_code="test", meta_server=meta_server, acks_with_pulls=with_pulls, ack_flush_ms=60_000
    ) as consumer:
        pc = consumer.pull_consumer(subject, "g", "earliest")
        got = await _pull(pc, 2)
        assert len(got) == 2
        got[0].ack()
        got[1]._tracker.ack(got[1]._offset + 100)  # a position this broker never handed out
        got[1]._tracker.ack(got[1]._offset + 101)
        if with_pulls:
            await pc.pull(10, 0)  # the acks ride on it
        await consumer.flush_acks()
        assert consumer.acks_unheld == 2
        assert "did not hold 2 of the acknowledged messages" in caplog.text
        assert not consumer.acks_pending
