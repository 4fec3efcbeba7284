"""That a group is ordered survives a broker restart (a clean stop, written in the checkpoint; a
``kill -9``, replayed from the group's PULL actions): after the restart the broker does not treat
the group's silent consumer as an unordered one, whose unacknowledged messages would go through
``%RETRY%`` (out of order) after ``consumer_offline_ms``; its keys go on, in order, on the next
consumer."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import pytest
from orderhelpers import order_problems, send_keys

from qmq.aio import Consumer
from qmq.common.naming import retry_subject
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEYS = 10
PER_KEY = 3
# short enough to pass within the test, long enough that the restarted broker's first round of
# the silent-consumer check does not come before the test is ready to look
OFFLINE_MS = 1_000
CONFIG = {"broker": {"consumer_offline_ms": OFFLINE_MS, "ordered_lease_ms": 2_000, "checkpoint_interval_ms": 60_000}}


@pytest.mark.parametrize("stop", ["sigterm", "sigkill"])
async def test_a_group_stays_ordered_across_a_restart(tmp_path: Path, stop: str) -> None:
    subject, group = "restart.orders", "billing"
    data = tmp_path / "data"
    with running_standalone(data, CONFIG) as sa:
        await send_keys(sa.meta_server, subject, KEYS, PER_KEY)
        async with Consumer(app_code="t", meta_server=sa.meta_server, consumer_id="a") as a:
            pull_a = a.pull_consumer(subject, group, "earliest", ordered=True)
            pulled = await pull_a.pull(max_messages=100, timeout_ms=5000)
            assert len(pulled) == KEYS  # one of each key handed out, none acknowledged
        if stop == "sigkill":
            sa.proc.send_signal(signal.SIGKILL)  # nothing written at the stop: the action log says it
            sa.proc.wait()
    with running_standalone(data, CONFIG) as sa:
        await asyncio.sleep(OFFLINE_MS * 3 / 1000)  # a's messages unacknowledged, a silent past it
        handled: list[tuple[str, int]] = []
        async with Consumer(app_code="t", meta_server=sa.meta_server, consumer_id="b") as b:
            pull_b = b.pull_consumer(subject, group, "earliest", ordered=True)
            async with asyncio.timeout(20):
                while len(handled) < KEYS * PER_KEY:
                    batch = await pull_b.pull(max_messages=100, timeout_ms=1000)
                    handled += [(str(m.order_key), int(m.body)) for m in batch]
                    await batch.ack_all()
            # nothing of the group went through its retry subject
            retry = b.pull_consumer(retry_subject(subject, group), "check", "earliest")
            assert not await retry.pull(max_messages=100, timeout_ms=1000)
    assert order_problems(handled, [f"k{i}" for i in range(KEYS)], PER_KEY) == []
