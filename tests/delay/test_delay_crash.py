"""kill -9 of the delay server while messages are coming due: after the supervisor restarts it,
no acknowledged message is lost, none reaches a consumer twice, and the ones that fell due
while it was down are delivered within seconds of the restart."""

from __future__ import annotations

import asyncio
import os
import signal
import time
import uuid
from pathlib import Path

import pytest
from delaywire import collect, delay_group, now_ms, wait_until

from qmq.aio import Consumer, Producer
from qmq.testing import metric_value, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MESSAGES = 400
SPREAD_S = 4.0
FIRST_DUE_S = 1.0
KILL_AFTER_S = 2.0
OVERDUE_AFTER_RESTART_MS_MAX = 3_000


def broker_duplicates(meta_server: str) -> float:
    """The broker's count of repeats its duplicate window dropped (hand-overs repeated after the crash)."""
    from delaywire import meta_address

    return metric_value(meta_address(meta_server)["broker_groups"][0]["http"], "qmq_duplicates_total")


async def test_kill_9_while_messages_come_due_loses_none_and_repeats_none(tmp_path: Path) -> None:
    config = {"delay": {"bucket_ms": 2_000, "preload_ms": 300, "checkpoint_interval_ms": 300}}
    subject = f"crash.{uuid.uuid4().hex[:12]}"
    with running_standalone(tmp_path / "qmq-data", config) as standalone:
        url = standalone.meta_server
        old_address = standalone.ready["delay"]
        due: dict[str, int] = {}
        async with (
            Producer(app_code="t", meta_server=url) as producer,
            Consumer(app_code="t", meta_server=url) as consumer,
        ):
            pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
            start = time.time()
            futures = []
            for i in range(MESSAGES):
                m = producer.generate_message(subject)
                m.set_deliver_at(start + FIRST_DUE_S + SPREAD_S * i / MESSAGES)
                due[m.message_id] = m.deliver_at_ms
                futures.append(producer.send_nowait(m))
            for f in futures:
                await f  # every message acknowledged by the delay server before the crash
            receiving = asyncio.ensure_future(collect(pull, MESSAGES, timeout_s=30))
            await asyncio.sleep(max(0.0, start + KILL_AFTER_S - time.time()))  # let some come due first
            killed_at = now_ms()
            os.kill(int(standalone.ready["delay_pid"]), signal.SIGKILL)
            restarted = await wait_until(
                "the supervisor's restart of the delay server",
                lambda: delay_group(url)["address"] != old_address,
                timeout_s=20,
            )
            assert restarted
            restarted_at = now_ms()
            got = await receiving
        duplicates = broker_duplicates(url)
    assert set(got) == set(due), f"{len(set(due) - set(got))} acknowledged messages were lost"
    lateness = [got[mid] - due[mid] for mid in due]
    assert min(lateness) >= 0, "a message was delivered before it was due"
    overdue = [mid for mid, d in due.items() if killed_at <= d <= restarted_at]
    assert overdue, "the kill came too late to leave messages falling due while the server was down"
    worst = max(got[mid] for mid in overdue) - restarted_at
    assert worst <= OVERDUE_AFTER_RESTART_MS_MAX, f"overdue messages came {worst:.0f} ms after the restart"
    # hand-overs repeated after the crash are few (those in flight) and the broker dropped them all
    assert duplicates < 100
