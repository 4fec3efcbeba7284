"""Retry timing through the delay server: the configured back-off per attempt, NeedRetry,
and the blocking SDK's listener keywords."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from datetime import timedelta

import pytest
from clienthelpers import wait_for_lag

import qmq
from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.cli.admin import ask_every_broker
from qmq.client.sync import ReceivedMessage as SyncReceived
from qmq.common.naming import retry_subject
from qmq.protocol.codes import RequestCode

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


async def _dead_letters(meta_server: str, subject: str, group: str) -> int:
    answers = await ask_every_broker(meta_server, RequestCode.DEAD_LETTERS, {"subject": subject, "group": group})
    return sum(h["total"] for h in answers.values() if isinstance(h, dict))


# Slack for a retry on a loaded 2-core machine: it may come this much later than its back-off,
# never sooner (less scheduling noise).
LATE_S_MAX = 2.5
EARLY_S_MAX = 0.05


async def test_fails_twice_then_succeeds_with_the_configured_back_off(meta_server: str, subject: str) -> None:
    group = _group()
    seen: list[tuple[int, float]] = []
    done = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await producer.send(producer.generate_message(subject))
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, group, start_from="earliest", retry_backoff=[1, 4], max_retries=5)
        async def on_message(m: ReceivedMessage) -> None:
            seen.append((m.times, time.monotonic()))
            if m.times < 3:
                raise ValueError(f"attempt {m.times} fails")
            done.set()

        await asyncio.wait_for(done.wait(), 30)
        await wait_for_lag(meta_server, subject, group, "unacked", 0)
    assert [t for t, _at in seen] == [1, 2, 3]
    gaps = [seen[i + 1][1] - seen[i][1] for i in range(2)]
    # Each attempt waits its own back-off (1 s, then 4 s): never less, and not the other one.
    assert 1 - EARLY_S_MAX <= gaps[0] <= 1 + LATE_S_MAX, gaps
    assert 4 - EARLY_S_MAX <= gaps[1] <= 4 + LATE_S_MAX, gaps
    assert await _dead_letters(meta_server, subject, group) == 0


async def test_need_retry_asks_for_a_specific_time(meta_server: str, subject: str) -> None:
    group = _group()
    seen: list[float] = []
    done = asyncio.Event()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await producer.send(producer.generate_message(subject))
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(subject, group, start_from="earliest", retry_backoff=[30])
        async def on_message(m: ReceivedMessage) -> None:
            seen.append(time.monotonic())
            if m.times == 1:
                raise qmq.NeedRetry(after=timedelta(milliseconds=1500))
            done.set()

        await asyncio.wait_for(done.wait(), 15)
    assert 1.4 <= seen[1] - seen[0] <= 2.5


def test_blocking_listener_takes_the_same_keywords(meta_server: str, subject: str) -> None:
    """tags filter on the broker; consume_most_once acknowledges on receipt, so a handler that
    raises is never retried: nothing comes back, even well after its 1 s back-off."""
    group = _group()
    got: list[str] = []
    done = threading.Event()
    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        for name, tags in (("vip", ("vip",)), ("plain", ()), ("vip2", ("vip",))):
            m = producer.generate_message(subject)
            for t in tags:
                m.add_tag(t)
            m.body = name.encode()
            producer.send(m)
    with qmq.Consumer(app_code="billing", meta_server=meta_server) as consumer:

        @consumer.listener(
            subject, group, start_from="earliest", tags=["vip"], consume_most_once=True, retry_backoff=[1]
        )
        def on_message(m: SyncReceived) -> None:
            got.append(bytes(m.body).decode())
            if len(got) == 2:
                done.set()
            raise RuntimeError("ignored: consume-most-once never retries")

        assert done.wait(10)
        # A retry would be due 1 s after each failure: wait three times that for one to come.
        time.sleep(3)  # waiting for something that must not happen: no event to wait on
    assert sorted(got) == ["vip", "vip2"]
    with qmq.Consumer(app_code="audit", meta_server=meta_server) as auditor:
        # nothing was sent to the group's retry subject either (read directly, from its start)
        retried = auditor.pull_consumer(retry_subject(subject, group), "audit", start_from="earliest")
        assert [m.message_id for m in retried.pull(max_messages=10, timeout_ms=500)] == []
    assert asyncio.run(_dead_letters(meta_server, subject, group)) == 0
