"""Consumer groups against a real broker: sharing a backlog, acks out of order, coming back."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from clienthelpers import pull_until

from qmq.aio import Consumer, Producer, ReceivedMessage

pytestmark = pytest.mark.integration


async def _send(meta_server: str, subject: str, n: int) -> list[str]:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msgs = [producer.generate_message(subject) for _ in range(n)]
        for i, m in enumerate(msgs):
            m.set_property("i", i)
        await asyncio.gather(*(producer.send_nowait(m) for m in msgs))
    return [m.message_id for m in msgs]


def _consumer(meta_server: str, consumer_id: str | None = None) -> Consumer:
    return Consumer(app_code="billing", meta_server=meta_server, consumer_id=consumer_id)


async def test_two_consumers_of_a_group_split_a_backlog_without_overlap(meta_server: str, subject: str) -> None:
    sent = await _send(meta_server, subject, 2000)
    group = f"g-{uuid.uuid4().hex[:8]}"
    got: dict[str, list[str]] = {"a": [], "b": []}
    done = asyncio.Event()

    async def member(name: str, consumer: Consumer) -> None:
        pull = consumer.pull_consumer(subject, group, start_from="earliest")
        while not done.is_set():
            batch = await pull.pull(max_messages=100, timeout_ms=200)
            await batch.ack_all()
            got[name].extend(m.message_id for m in batch)
            if len(got["a"]) + len(got["b"]) >= len(sent):
                done.set()
            await asyncio.sleep(0)  # let the other member take its turn

    async with _consumer(meta_server, "split-a") as a, _consumer(meta_server, "split-b") as b:
        async with asyncio.timeout(30):
            await asyncio.gather(member("a", a), member("b", b))
    assert not set(got["a"]) & set(got["b"]), "a message went to both members of the group"
    assert sorted(got["a"] + got["b"]) == sorted(sent)
    assert got["a"], "member a received nothing"
    assert got["b"], "member b received nothing"


async def test_out_of_order_acks_never_skip_a_message(meta_server: str, subject: str) -> None:
    sent = await _send(meta_server, subject, 60)
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer_id = f"ooo-{uuid.uuid4().hex[:6]}"
    async with _consumer(meta_server, consumer_id) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, group, start_from="earliest"), 60, ack=False)
        assert [m.message_id for m in got] == sent
        skipped = {got[7].message_id, got[31].message_id}
        # Acks arrive in reverse and shuffled order, with two messages never acknowledged.
        for m in reversed(got[32:]):
            await m.ack()
        for m in got[8:31]:
            await m.ack()
        for m in got[:7]:
            await m.ack()
    async with _consumer(meta_server, consumer_id) as consumer:
        pull = consumer.pull_consumer(subject, group, start_from="earliest")
        again = await pull_until(pull, 2)
        assert {m.message_id for m in again} == skipped
        assert len(await pull.pull(max_messages=100, timeout_ms=300)) == 0


async def test_a_restarted_consumer_gets_back_what_it_never_acked(meta_server: str, subject: str) -> None:
    sent = await _send(meta_server, subject, 10)
    group = f"g-{uuid.uuid4().hex[:8]}"
    consumer_id = f"restart-{uuid.uuid4().hex[:6]}"
    async with _consumer(meta_server, consumer_id) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, group, start_from="earliest"), 10, ack=False)
        for m in got[:5]:
            await m.ack()
    async with _consumer(meta_server, consumer_id) as consumer:
        again = await pull_until(consumer.pull_consumer(subject, group, start_from="earliest"), 5)
    assert [m.message_id for m in again] == sent[5:]
    assert all(m.times == 1 for m in again)  # a re-delivery is not a failed attempt


async def test_a_new_connection_is_a_new_session_and_gets_back_the_unacked(meta_server: str, subject: str) -> None:
    sent = await _send(meta_server, subject, 6)
    group = f"g-{uuid.uuid4().hex[:8]}"
    async with _consumer(meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group, start_from="earliest")
        first: list[ReceivedMessage] = await pull_until(pull, 6, ack=False)
        for m in first[:2]:
            await m.ack()
        pool = consumer._ctx.pool
        assert pool is not None
        for conn in pool._connections.values():
            conn.abort()  # the connection drops; the next pull reconnects
        again = await pull_until(pull, 4)
    assert [m.message_id for m in again] == sent[2:]
