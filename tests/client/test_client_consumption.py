"""Consumption semantics through the SDK against a real standalone: tags, broadcast,
consume-most-once, manual acks, filters and idempotent checkers."""

from __future__ import annotations

import asyncio
import uuid
from typing import Any

import pytest
from clienthelpers import pull_until, wait_for_lag

from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.common.errors import ConfigError
from qmq.idempotency import MemoryIdempotentChecker

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def _send(meta_server: str, subject: str, specs: list[tuple[str, tuple[str, ...]]]) -> dict[str, str]:
    """Send one message per (name, tags); returns {message id: name}."""
    names: dict[str, str] = {}
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        for name, tags in specs:
            m = producer.generate_message(subject)
            for tag in tags:
                m.add_tag(tag)
            m.body = name.encode()
            await producer.send(m)
            names[m.message_id] = name
    return names


@pytest.mark.parametrize(("tag_type", "expected"), [("or", {"vip-eu", "vip", "eu"}), ("and", {"vip-eu"})])
async def test_tags_or_and_are_filtered_by_the_broker(
    meta_server: str, subject: str, tag_type: str, expected: set[str]
) -> None:
    await _send(meta_server, subject, [("vip-eu", ("vip", "eu")), ("plain", ()), ("vip", ("vip",)), ("eu", ("eu",))])
    group = _group()
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group, "earliest", tags=["vip", "eu"], tag_type=tag_type)
        got = await pull_until(pull, len(expected))
        assert {bytes(m.body).decode() for m in got} == expected
        assert not await pull.pull(max_messages=10, timeout_ms=200)
        assert (await wait_for_lag(meta_server, subject, group, "backlog", 0))["backlog"] == 0


async def test_broadcast_listeners_each_get_every_message(meta_server: str, subject: str) -> None:
    group = _group()
    seen: dict[str, list[str]] = {"a": [], "b": []}
    both = asyncio.Event()
    consumers = [Consumer(app_code="cache", meta_server=meta_server, consumer_id=f"node-{n}") for n in "ab"]
    for name, consumer in zip("ab", consumers, strict=True):
        await consumer.start()

        def handler_for(key: str) -> Any:
            async def on_message(m: ReceivedMessage) -> None:
                seen[key].append(bytes(m.body).decode())
                if all(len(v) == 3 for v in seen.values()):
                    both.set()

            return on_message

        consumer.add_listener(subject, group, handler_for(name), broadcast=True)
    try:
        # broadcast starts from the latest: wait until the broker knows both consumers' groups
        await asyncio.wait_for(_until_groups(meta_server, subject, {f"{group}%node-a", f"{group}%node-b"}), 10)
        await _send(meta_server, subject, [(f"m{i}", ()) for i in range(3)])
        await asyncio.wait_for(both.wait(), 10)
    finally:
        for consumer in consumers:
            await consumer.close()
    assert sorted(seen["a"]) == sorted(seen["b"]) == ["m0", "m1", "m2"]


async def _until_groups(meta_server: str, subject: str, groups: set[str]) -> None:
    from qmq.cli.admin import ask_every_broker
    from qmq.protocol.codes import RequestCode

    while True:
        answers = await ask_every_broker(meta_server, RequestCode.SUBJECTS, {})
        known = {
            g
            for h in answers.values()
            if isinstance(h, dict)
            for s in h["subjects"]
            if s["subject"] == subject
            for g in s["groups"]
        }
        if groups <= known:
            return
        await asyncio.sleep(0.02)


async def test_consume_most_once_never_retries(meta_server: str, subject: str) -> None:
    group = _group()
    await _send(meta_server, subject, [("once", ())])
    calls = 0
    called = asyncio.Event()
    async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=10) as consumer:

        @consumer.listener(subject, group, start_from="earliest", consume_most_once=True, retry_backoff=[0])
        async def on_message(_m: ReceivedMessage) -> None:
            nonlocal calls
            calls += 1
            called.set()
            raise RuntimeError("lost on purpose")

        await asyncio.wait_for(called.wait(), 10)
        await wait_for_lag(meta_server, subject, group, "unacked", 0)
        retry = consumer.pull_consumer(f"%RETRY%{subject}%{group}", "peek", "earliest")
        assert not await retry.pull(max_messages=10, timeout_ms=300)
    assert calls == 1


async def test_manual_ack_leaves_unacked_messages_unacked(meta_server: str, subject: str) -> None:
    group = _group()
    await _send(meta_server, subject, [("ack-me", ()), ("leave-me", ())])
    handled = asyncio.Event()
    names: list[str] = []
    async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=10) as consumer:

        @consumer.listener(subject, group, start_from="earliest", auto_ack=False)
        async def on_message(m: ReceivedMessage) -> None:
            names.append(bytes(m.body).decode())
            if bytes(m.body) == b"ack-me":
                await m.ack()
            if len(names) == 2:
                handled.set()

        await asyncio.wait_for(handled.wait(), 10)
        lag = await wait_for_lag(meta_server, subject, group, "unacked", 1)
    assert lag["unacked"] == 1


class Recorder:
    def __init__(self, skip: str) -> None:
        self.skip = skip
        self.pre_seen: list[str] = []
        self.post_seen: list[tuple[str, str | None]] = []

    def pre(self, m: ReceivedMessage) -> bool:
        self.pre_seen.append(bytes(m.body).decode())
        return bytes(m.body).decode() != self.skip

    def post(self, m: ReceivedMessage, exc: BaseException | None) -> None:
        self.post_seen.append((bytes(m.body).decode(), None if exc is None else str(exc)))


async def test_filters_skip_and_observe(meta_server: str, subject: str) -> None:
    group = _group()
    await _send(meta_server, subject, [("skip", ()), ("ok", ()), ("bad", ())])
    f = Recorder("skip")
    handled: list[str] = []
    done = asyncio.Event()
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, group, start_from="earliest", concurrency=1, filters=[f], max_retries=0)
        async def on_message(m: ReceivedMessage) -> None:
            handled.append(bytes(m.body).decode())
            if len(f.post_seen) == 2 or bytes(m.body) == b"bad":
                done.set()
            if bytes(m.body) == b"bad":
                raise ValueError("bad body")

        await asyncio.wait_for(done.wait(), 10)
        await asyncio.sleep(0)  # let post() of the last message run
    assert handled == ["ok", "bad"]
    assert f.pre_seen == ["skip", "ok", "bad"]
    assert f.post_seen == [("skip", None), ("ok", None), ("bad", "bad body")]


async def test_idempotent_checker_skips_a_redelivered_message(meta_server: str, subject: str) -> None:
    group = _group()
    await _send(meta_server, subject, [("pay", ())])
    checker = MemoryIdempotentChecker()
    effects: list[str] = []
    for _attempt in range(2):
        # the first consumer handles it but its ack never reaches the broker (auto_ack=False, no ack);
        # the second, under the same consumer id, gets it again: the checker skips the handler
        handled = asyncio.Event()
        async with Consumer(app_code="billing", meta_server=meta_server, consumer_id="ledger-1") as consumer:

            async def on_message(m: ReceivedMessage, done: asyncio.Event = handled) -> None:
                effects.append(bytes(m.body).decode())
                done.set()

            consumer.add_listener(
                subject, group, on_message, start_from="earliest", idempotent_checker=checker, auto_ack=_attempt == 1
            )
            if _attempt == 0:
                await asyncio.wait_for(handled.wait(), 10)
            else:
                await wait_for_lag(meta_server, subject, group, "unacked", 0)
    assert effects == ["pay"]


def test_bad_listener_options_are_named() -> None:
    consumer = Consumer(app_code="billing", meta_server="http://127.0.0.1:1/meta/address")

    async def h(_m: ReceivedMessage) -> None:
        return None

    with pytest.raises(ConfigError, match="tag_type='xor'"):
        consumer.listener("s", "g", tag_type="xor")(h)
    with pytest.raises(ConfigError, match="retry_backoff"):
        consumer.listener("s", "g", retry_backoff=[-1])(h)
    with pytest.raises(ConfigError, match="pre"):
        consumer.listener("s", "g", filters=[object()])(h)
