"""Listeners and failed messages against a real broker: acks on return, retries, dead letters."""

from __future__ import annotations

import asyncio
import logging
import uuid

import pytest
from clienthelpers import pull_until, wait_for_lag

from qmq.aio import Consumer, Producer, ReceivedMessage

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


@pytest.mark.smoke
async def test_a_listener_acks_what_its_handler_returns_from(meta_server: str, subject: str) -> None:
    group = _group()
    n = 300
    seen: list[str] = []
    running = 0
    most_running = 0
    all_seen = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        sent = [producer.generate_message(subject) for _ in range(n)]
        await asyncio.gather(*(producer.send(m) for m in sent))
        async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=20) as consumer:

            @consumer.listener(subject, group, start_from="earliest", concurrency=4, prefetch=50)
            async def on_message(m: ReceivedMessage) -> None:
                nonlocal running, most_running
                running += 1
                most_running = max(most_running, running)
                await asyncio.sleep(0)
                running -= 1
                seen.append(m.message_id)
                if len(seen) == n:
                    all_seen.set()

            await asyncio.wait_for(all_seen.wait(), 20)
            await wait_for_lag(meta_server, subject, group, "unacked", 0)
            assert consumer.listeners[0].handled == n
    assert sorted(seen) == sorted(m.message_id for m in sent)
    assert 1 < most_running <= 4


async def test_a_listener_added_to_an_open_consumer_starts_at_once(meta_server: str, subject: str) -> None:
    got = asyncio.Event()
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        async def handler(_m: ReceivedMessage) -> None:
            got.set()

        consumer.add_listener(subject, _group(), handler, start_from="earliest")
        async with Producer(app_code="shop", meta_server=meta_server) as producer:
            await producer.send(producer.generate_message(subject))
        await asyncio.wait_for(got.wait(), 10)


async def test_a_failed_handler_is_logged_with_the_message_id(
    meta_server: str, subject: str, caplog: pytest.LogCaptureFixture
) -> None:
    failed = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msg = producer.generate_message(subject)
        await producer.send(msg)
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, _group(), start_from="earliest", concurrency=1)
        async def on_message(_m: ReceivedMessage) -> None:
            failed.set()
            raise ValueError("boom")

        with caplog.at_level(logging.WARNING, logger="qmq.client.listener"):
            # The worker logs in the same step the handler raised in, before this wakes up.
            await asyncio.wait_for(failed.wait(), 10)
    assert any(msg.message_id in r.getMessage() and "boom" in r.getMessage() for r in caplog.records)


async def test_a_handler_that_raises_once_gets_the_message_again_with_times_2(meta_server: str, subject: str) -> None:
    attempts: list[tuple[str, int, str]] = []
    second = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msg = producer.generate_message(subject)
        msg.set_property("orderId", "42")
        await producer.send(msg)
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, _group(), start_from="earliest", concurrency=1, retry_backoff=[0])
        async def on_message(m: ReceivedMessage) -> None:
            attempts.append((m.message_id, m.times, m.subject))
            if m.times == 1:
                raise ValueError("first attempt fails")
            assert m.get_property("orderId") == "42"
            second.set()

        await asyncio.wait_for(second.wait(), 5)
    assert attempts == [(msg.message_id, 1, subject), (msg.message_id, 2, subject)]


async def test_a_nacked_pulled_message_comes_back_to_the_pull_consumer(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msg = producer.generate_message(subject)
        await producer.send(msg)
    async with Consumer(app_code="billing", meta_server=meta_server, retry_pull_interval_ms=50) as consumer:
        pull = consumer.pull_consumer(subject, _group(), start_from="earliest", retry_backoff=[0])
        [first] = await pull_until(pull, 1, ack=False)
        await first.nack(ValueError("not now"))
        [again] = await pull_until(pull, 1, timeout_s=5)
    assert (again.message_id, again.times, again.subject) == (msg.message_id, 2, subject)


async def test_after_max_retries_a_message_goes_to_the_dead_letters(meta_server: str, subject: str) -> None:
    from qmq.cli.admin import ask_every_broker
    from qmq.protocol.codes import RequestCode

    group = _group()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msg = producer.generate_message(subject)
        await producer.send(msg)
    async with Consumer(app_code="billing", meta_server=meta_server, max_retries=1) as consumer:
        attempts = 0
        gave_up = asyncio.Event()

        @consumer.listener(subject, group, start_from="earliest", concurrency=1, retry_backoff=[0])
        async def on_message(_m: ReceivedMessage) -> None:
            nonlocal attempts
            attempts += 1
            if attempts == 2:
                gave_up.set()
            raise ValueError("always fails")

        await asyncio.wait_for(gave_up.wait(), 10)
        letters: list[dict[str, object]] = []
        deadline = asyncio.get_running_loop().time() + 10
        while not letters and asyncio.get_running_loop().time() < deadline:
            answers = await ask_every_broker(
                meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group}
            )
            letters = [letter for h in answers.values() if isinstance(h, dict) for letter in h["letters"]]
            if not letters:
                await asyncio.sleep(0.05)  # the dead letter is stored right after the second failure
    assert attempts == 2
    [letter] = letters
    assert (letter["message_id"], letter["attempts"], letter["error"]) == (
        msg.message_id,
        2,
        "ValueError: always fails",
    )


async def test_a_listener_keeps_at_most_prefetch_messages_in_the_app(meta_server: str, subject: str) -> None:
    n, prefetch = 100, 10
    release = asyncio.Event()
    started = 0
    two_started = asyncio.Event()
    handled: list[str] = []
    all_handled = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await asyncio.gather(*(producer.send(producer.generate_message(subject)) for _ in range(n)))
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, _group(), start_from="earliest", concurrency=2, prefetch=prefetch)
        async def on_message(m: ReceivedMessage) -> None:
            nonlocal started
            started += 1
            if started == 2:
                two_started.set()
            await release.wait()
            handled.append(m.message_id)
            if len(handled) == n:
                all_handled.set()

        await asyncio.wait_for(two_started.wait(), 10)
        listener = consumer.listeners[0]
        pulled = sum(p.messages for p in listener._pullers)
        assert 2 <= pulled <= prefetch
        assert listener._in_app + listener._reserved <= prefetch
        release.set()
        await asyncio.wait_for(all_handled.wait(), 20)
    assert len(set(handled)) == n


async def test_listeners_registered_before_start_run_once_it_starts(meta_server: str, subject: str) -> None:
    got = asyncio.Event()
    consumer = Consumer(app_code="billing", meta_server=meta_server)

    @consumer.listener(subject, _group(), start_from="earliest")
    async def on_message(_m: ReceivedMessage) -> None:
        got.set()

    assert not consumer.listeners[0].running
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await producer.send(producer.generate_message(subject))
    async with consumer:
        assert consumer.listeners[0].running
        await asyncio.wait_for(got.wait(), 10)
    assert not consumer.listeners[0].running
