"""Cancelling pending delay messages through real processes: before it is due (True, never
delivered), after it was handed over (False), an unknown id (False), from the blocking SDK and
from `qmq cancel-delay --json`; a cancel that survives `kill -9` of the delay server; and a
cancelled message that its loaded bucket does not hold in memory."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from delaywire import collect, delay_group, request, wait_until
from test_delay_cli import qmq

import qmq as blocking
from qmq.aio import Consumer, Producer
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_standalone

pytestmark = pytest.mark.integration

# how long after the due time a test keeps pulling to see that a cancelled message never comes
QUIET_S = 1.5


async def test_cancel_before_due_after_hand_over_and_unknown(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url) as consumer,
    ):
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        due = time.time() + 2.0
        kept, cancelled = producer.generate_message(subject), producer.generate_message(subject)
        for m in (kept, cancelled):
            m.set_deliver_at(due)
            await producer.send(m)
        assert await producer.cancel_delay(cancelled.message_id) is True
        assert await producer.cancel_delay(cancelled.message_id) is False, "cancelled already: nothing pending"
        assert await producer.cancel_delay(f"never-sent-{uuid.uuid4().hex}") is False
        got = await collect(pull, 2, timeout_s=due - time.time() + QUIET_S)
        assert set(got) == {kept.message_id}, "the cancelled message was delivered (or the other one was not)"
        assert await producer.cancel_delay(kept.message_id) is False, "handed over already"


def test_the_blocking_producer_cancels(shared_standalone: ReadyProcess, subject: str) -> None:
    with blocking.Producer(app_code="t", meta_server=shared_standalone.meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_delay(60)
        producer.send(m)
        assert producer.cancel_delay(m.message_id) is True
        assert producer.cancel_delay(m.message_id) is False


def test_cancel_delay_command_with_json(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    sent = qmq("send", subject, "--delay", "60s", "--body", "x", meta_server=url)
    assert sent.returncode == 0, sent.stderr
    message_id = sent.stdout.strip()
    first = qmq("cancel-delay", message_id, "--json", meta_server=url)
    assert first.returncode == 0, first.stderr
    assert json.loads(first.stdout) == {"message_id": message_id, "cancelled": True}
    again = qmq("cancel-delay", message_id, meta_server=url)
    assert again.returncode == 0, again.stderr
    assert again.stdout.startswith("not pending:"), again.stdout
    bad = qmq("cancel-delay", "has space", meta_server=url)
    assert bad.returncode == 2, bad.stderr
    assert "whitespace" in bad.stderr


async def test_a_cancel_survives_kill_9_of_the_delay_server(tmp_path: Path) -> None:
    # no checkpoint before the kill: recovery finds the cancels in the write-ahead log
    config = {"delay": {"bucket_ms": 2_000, "preload_ms": 300, "checkpoint_interval_ms": 600_000}}
    subject = f"cancel.{uuid.uuid4().hex[:12]}"
    with running_standalone(tmp_path / "qmq-data", config) as standalone:
        url = standalone.meta_server
        old_address = standalone.ready["delay"]
        async with (
            Producer(app_code="t", meta_server=url) as producer,
            Consumer(app_code="t", meta_server=url) as consumer,
        ):
            due = time.time() + 4.0
            messages = []
            for _ in range(40):
                m = producer.generate_message(subject)
                m.set_deliver_at(due)
                messages.append(m)
            await asyncio.gather(*(producer.send(m) for m in messages))
            cancelled = {m.message_id for m in messages[::2]}
            answers = await asyncio.gather(*(producer.cancel_delay(mid) for mid in cancelled))
            assert all(answers)
            os.kill(int(standalone.ready["delay_pid"]), signal.SIGKILL)
            await wait_until(
                "the supervisor's restart of the delay server",
                lambda: delay_group(url)["address"] != old_address,
                timeout_s=20,
            )
            pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
            got = await collect(pull, len(messages), timeout_s=due - time.time() + 3 * QUIET_S)
    assert set(got) == {m.message_id for m in messages} - cancelled


async def test_a_loaded_bucket_holds_no_row_of_a_cancelled_message(tmp_path: Path) -> None:
    bucket_ms, preload_ms = 5_000, 4_000
    config = {"delay": {"bucket_ms": bucket_ms, "preload_ms": preload_ms}}
    subject = f"cancel.{uuid.uuid4().hex[:12]}"
    with running_standalone(tmp_path / "qmq-data", config) as standalone:
        url = standalone.meta_server
        address = standalone.ready["delay"]
        now_ms = int(time.time() * 1000)
        start_ms = (now_ms + 8_000) // bucket_ms * bucket_ms + bucket_ms  # loads at least 4 s from now
        async with Producer(app_code="t", meta_server=url) as producer:
            messages = []
            for i in range(500):
                m = producer.generate_message(subject)
                m.set_deliver_at((start_ms + preload_ms + i) / 1000)  # due after the bucket loads
                messages.append(m)
            await asyncio.gather(*(producer.send(m) for m in messages))
            assert all(await asyncio.gather(*(producer.cancel_delay(m.message_id) for m in messages[50:])))

        async def loaded() -> dict[str, object] | None:
            stats = answer_of(await request(address, RequestCode.DELAY_STATS, {"buckets_max": 100}))
            mine = [b for b in stats["buckets"] if b["start_ms"] == start_ms]
            return stats if mine and mine[0]["loaded"] else None

        stats = await wait_until("the bucket's load", loaded, timeout_s=20, interval_s=0.1)
        assert stats["timer_rows"] == 50, "the timer holds rows of cancelled messages"
        assert stats["pending"] == 50
