"""Ordered consumption through a real `qmq standalone`: ordered listeners and pull consumers of
both SDKs, in-place retries, and slots served to one consumer at a time."""

from __future__ import annotations

import asyncio
import random
import threading
import time
import uuid

import pytest
from orderhelpers import order_problems, send_keys

import qmq
from qmq.aio import Consumer, Producer, ReceivedMessage

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


@pytest.mark.timeout(120)
async def test_two_ordered_listeners_share_the_keys_and_run_each_key_alone_in_order(
    meta_server: str, subject: str
) -> None:
    keys, per_key = 200, 10
    group = _group()
    handled: list[tuple[str, int]] = []
    running: dict[str, str] = {}
    overlaps: list[str] = []
    by_consumer: dict[str, int] = {}
    done = asyncio.Event()
    rng = random.Random(3)

    def make(name: str):  # type: ignore[no-untyped-def]
        async def handle(m: ReceivedMessage) -> None:
            key = m.order_key
            assert key is not None
            if key in running:
                overlaps.append(f"{key} ran on {running[key]} and {name} at once")
            running[key] = name
            await asyncio.sleep(rng.random() / 500)
            del running[key]
            handled.append((key, int(m.body)))
            by_consumer[name] = by_consumer.get(name, 0) + 1
            if len(handled) >= keys * per_key:
                done.set()

        return handle

    async with (
        Consumer(app_code="t", meta_server=meta_server, consumer_id="c1") as c1,
        Consumer(app_code="t", meta_server=meta_server, consumer_id="c2") as c2,
    ):
        c1.add_listener(subject, group, make("c1"), start_from="earliest", ordered=True, concurrency=8)
        c2.add_listener(subject, group, make("c2"), start_from="earliest", ordered=True, concurrency=8)
        await send_keys(meta_server, subject, keys, per_key)
        async with asyncio.timeout(90):
            await done.wait()
    assert overlaps == []
    assert order_problems(handled, [f"k{i}" for i in range(keys)], per_key) == []
    assert set(by_consumer) == {"c1", "c2"}  # both got slots


@pytest.mark.timeout(120)
async def test_a_failing_message_is_retried_in_place_then_dead_lettered_and_its_key_goes_on(
    meta_server: str, subject: str
) -> None:
    group = _group()
    seen: list[tuple[str, int, int]] = []  # key, n, attempt
    done = asyncio.Event()

    async def handle(m: ReceivedMessage) -> None:
        key, n = m.order_key, int(m.body)
        assert key is not None
        seen.append((key, n, m.times))
        if key == "k0" and n == 1 and m.times < 3:
            raise RuntimeError("fails twice, then passes")
        if key == "k1" and n == 1:
            raise RuntimeError("always fails")
        if len({(k, n) for k, n, _t in seen}) == 3 * 4:
            done.set()

    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        listener = consumer.add_listener(
            subject, group, handle, start_from="earliest", ordered=True, max_retries=2, retry_backoff=[0.05]
        )
        await send_keys(meta_server, subject, 3, 4)
        async with asyncio.timeout(60):
            await done.wait()
        # nothing went through the retry subject: the retry puller of an ordered listener does not exist
        assert len(listener._pullers) == 1
    per_key = {k: [(n, t) for kk, n, t in seen if kk == k] for k in ("k0", "k1", "k2")}
    assert per_key["k0"] == [(0, 1), (1, 1), (1, 2), (1, 3), (2, 1), (3, 1)]
    assert per_key["k1"] == [(0, 1), (1, 1), (1, 2), (1, 3), (2, 1), (3, 1)]  # 3 attempts, dead, then on
    assert per_key["k2"] == [(0, 1), (1, 1), (2, 1), (3, 1)]


async def test_an_ordered_pull_consumer_hands_one_message_per_key_until_it_is_acked(
    meta_server: str, subject: str
) -> None:
    await send_keys(meta_server, subject, 3, 3)
    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, _group(), "earliest", ordered=True, retry_backoff=[0.05])
        first = await pull.pull(max_messages=100, timeout_ms=5000)
        assert sorted((m.order_key, int(m.body)) for m in first) == [("k0", 0), ("k1", 0), ("k2", 0)]
        assert not await pull.pull(max_messages=100, timeout_ms=300)  # every key has one out
        by_key = {m.order_key: m for m in first}
        by_key["k0"].ack()
        await by_key["k1"].nack(RuntimeError("again, in place"))
        second = await pull.pull(max_messages=100, timeout_ms=2000)
        assert [(m.order_key, int(m.body)) for m in second] == [("k0", 1)]
        third = await pull.pull(max_messages=100, timeout_ms=2000)  # k1's comes back after the back-off
        assert [(m.order_key, int(m.body), m.times) for m in third] == [("k1", 0, 2)]


@pytest.mark.timeout(120)
def test_the_blocking_sdk_has_ordered_listeners_and_sends(meta_server: str, subject: str) -> None:
    keys, per_key = 20, 5
    handled: list[tuple[str, int]] = []
    lock = threading.Lock()
    done = threading.Event()
    with qmq.Producer(app_code="t", meta_server=meta_server) as producer:
        futures = []
        for n in range(per_key):
            for i in range(keys):
                m = producer.generate_message(subject)
                m.set_order_key(f"k{i}")
                m.body = str(n).encode()
                futures.append(producer.send_async(m))
        for f in futures:
            f.result(30)

    def handle(m: qmq.ReceivedMessage) -> None:
        time.sleep(0.001)
        key = m.order_key
        assert key is not None
        with lock:
            handled.append((key, int(m.body)))
            if len(handled) == keys * per_key:
                done.set()

    with qmq.Consumer(app_code="t", meta_server=meta_server, listener_threads=8) as consumer:
        consumer.add_listener(subject, _group(), handle, start_from="earliest", ordered=True)
        assert done.wait(60)
        pull = consumer.pull_consumer(subject, _group(), "earliest", ordered=True)
        batch = pull.pull(max_messages=100, timeout_ms=5000)
        assert sorted(int(m.body) for m in batch) == [0] * keys
    assert order_problems(handled, [f"k{i}" for i in range(keys)], per_key) == []


async def test_unordered_groups_of_an_ordered_subject_are_unchanged(meta_server: str, subject: str) -> None:
    await send_keys(meta_server, subject, 5, 4)
    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, _group(), "earliest")
        batch = await pull.pull(max_messages=100, timeout_ms=5000)
        assert len(batch) == 20  # all at once, keys regardless
        await batch.ack_all()
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        await producer.send(producer.generate_message(subject))  # and unordered messages still go
