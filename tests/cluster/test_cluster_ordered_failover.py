"""Ordered messages across a broker master's failover, on a cluster of 2 broker groups of a master
and a slave: with ``order="strict"`` each key's messages stay on its slot's group (sends to the
failed group wait for its slave's promotion), and two ordered consumers handle every key in send
order, a message never acknowledged possibly repeated, never skipped or reordered."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config

from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.common.ordering import group_of_slot, slot_of

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SUBJECT = "failover.ordered"
KEYS = 200
PER_KEY = 30
KILL_AFTER_ROUND = 10


def order_problems(handled: list[tuple[str, int]]) -> list[str]:
    """Per key: never more than one past the highest handled before (no skip, no reorder), all handled."""
    top = {f"k{i}": -1 for i in range(KEYS)}
    problems = []
    for key, n in handled:
        if n > top[key] + 1:
            problems.append(f"{key}: {n} handled after {top[key]}")
        top[key] = max(top[key], n)
    return problems + [f"{k}: only up to {t}" for k, t in top.items() if t != PER_KEY - 1]


async def test_strict_ordered_keys_survive_a_master_failover_in_order(tmp_path: Path) -> None:
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "0"]
    config = fast_config(tmp_path / "fast.toml", {"broker": {"ordered_lease_ms": 5_000}})
    with cluster_up(tmp_path / "cluster", args, config) as c:
        await asyncio.to_thread(
            c.wait_view,
            "both slaves replicating",
            lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 2,
        )
        handled: list[tuple[str, int]] = []
        where: dict[str, set[str]] = {}
        finished: set[str] = set()  # keys whose last message was handled
        done = asyncio.Event()

        async def handle(m: ReceivedMessage) -> None:
            key = m.order_key
            assert key is not None
            await asyncio.sleep(0.001)
            handled.append((key, int(m.body)))
            where.setdefault(key, set()).add(m._tracker.broker_group)
            if int(m.body) == PER_KEY - 1:
                finished.add(key)
                if len(finished) == KEYS:
                    done.set()

        async with (
            Producer(app_code="t", meta_server=c.meta_server, send_timeout_ms=60_000, retry_backoff_ms=20) as producer,
            Consumer(app_code="t", meta_server=c.meta_server, consumer_id="c1") as c1,
            Consumer(app_code="t", meta_server=c.meta_server, consumer_id="c2") as c2,
        ):
            for consumer in (c1, c2):
                consumer.add_listener(SUBJECT, "billing", handle, start_from="earliest", ordered=True, concurrency=8)
            await producer.prepare([SUBJECT])
            for n in range(PER_KEY):
                if n == KILL_AFTER_ROUND:
                    os.kill(c.member("b1-m").pid, signal.SIGKILL)
                futures = []
                for i in range(KEYS):
                    m = producer.generate_message(SUBJECT)
                    m.set_order_key(f"k{i}")  # order="strict": the key's group or nothing
                    m.body = str(n).encode()
                    futures.append(producer.send_nowait(m))
                await asyncio.gather(*futures)  # every send stored: none failed, none went elsewhere
            # the failover happened while the keys were sent
            promoted = lambda v: any(g["group"] == "b1" and g["epoch"] == 2 for g in v["groups"])  # noqa: E731
            await asyncio.to_thread(c.wait_view, "b1's slave promoted", promoted)
            async with asyncio.timeout(120):
                await done.wait()
        route = ("b1", "b2")
        assert order_problems(handled) == []
        assert {k: g for k, g in where.items() if g != {group_of_slot(slot_of(k), route)}} == {}
        assert {g for gs in where.values() for g in gs} == {"b1", "b2"}
