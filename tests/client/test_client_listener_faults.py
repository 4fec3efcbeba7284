"""A listener keeps its workers whatever a handler raises, and says so when it cannot go on."""

from __future__ import annotations

import asyncio
import os
import threading
import uuid

import pytest
from clienthelpers import wait_for_dead_letters

import qmq
from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.client.received import ReceivedBase

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def test_error_text_that_is_not_valid_utf8_costs_no_worker(meta_server: str, subject: str) -> None:
    # os.fsdecode of a non-UTF-8 path holds a lone surrogate: the retry copy's error property
    # could not be encoded, and each such failure ended a worker task without a word.
    group = _group()
    bad, good = 4, 50
    handled: set[str] = set()
    all_good = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        poison = [producer.generate_message(subject) for _ in range(bad)]
        for m in poison:
            m.set_property("kind", "bad")
        await asyncio.gather(*(producer.send(m) for m in poison))
        fine = [producer.generate_message(subject) for _ in range(good)]
        await asyncio.gather(*(producer.send(m) for m in fine))
        async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=20, max_retries=0) as consumer:

            @consumer.listener(subject, group, start_from="earliest", concurrency=4, prefetch=4)
            async def on_message(m: ReceivedMessage) -> None:
                if m.get_property("kind") == "bad":
                    raise FileNotFoundError(os.fsdecode(b"/data/\xff.csv"))
                handled.add(m.message_id)
                if len(handled) == good:
                    all_good.set()

            await asyncio.wait_for(all_good.wait(), 30)
            assert consumer.errors == []
            # the failed ones went to the dead letters, their error text kept (escaped)
            dead = await wait_for_dead_letters(meta_server, subject, group, bad)
    assert {letter["message_id"] for letter in dead} == {m.message_id for m in poison}
    assert {letter["error"] for letter in dead} == {"FileNotFoundError: /data/\\udcff.csv"}


async def test_a_failure_path_that_raises_anything_keeps_the_worker(meta_server: str, subject: str) -> None:
    group = _group()
    seen: list[str] = []
    done = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        sent = [producer.generate_message(subject) for _ in range(10)]
        await asyncio.gather(*(producer.send(m) for m in sent))
    async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=20) as consumer:
        calls = 0

        async def broken_fail(_m: object, _exc: BaseException | None) -> None:
            raise RuntimeError("a bug in the failure path")

        @consumer.listener(subject, group, start_from="earliest", concurrency=1, prefetch=1)
        async def on_message(m: ReceivedMessage) -> None:
            nonlocal calls
            calls += 1
            if calls <= 3:
                raise ValueError("fails")
            seen.append(m.message_id)
            if len(seen) == 7:
                done.set()

        consumer.listeners[0]._fail = broken_fail  # the failure path itself fails, unexpectedly
        await asyncio.wait_for(done.wait(), 30)
        assert consumer.listeners[0].running


def test_the_blocking_consumer_keeps_its_workers_too(meta_server: str, subject: str) -> None:
    group = _group()
    handled: list[str] = []
    done = threading.Event()
    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        for i in range(4 + 32):
            m = producer.generate_message(subject)
            m.set_property("kind", "bad" if i < 4 else "good")
            producer.send(m)
    with qmq.Consumer(app_code="billing", meta_server=meta_server, max_retries=0) as consumer:

        def on_message(m: ReceivedBase) -> None:
            if m.get_property("kind") == "bad":
                raise FileNotFoundError(os.fsdecode(b"/data/\xff.csv"))
            handled.append(m.message_id)
            if len(handled) == 32:
                done.set()

        consumer.add_listener(subject, group, on_message, start_from="earliest", concurrency=4, prefetch=4)
        assert done.wait(30), f"handled {len(handled)} of 32 good messages"
