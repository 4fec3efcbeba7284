"""A delayed send whose delay group answered "not master, outcome unknown" (its master wrote the
message, then lost its slave before the slave had it) is sent again to the delay group, never
to a broker group: the delay master keeps its copy and hands it over, when due, to the broker
group the message id picks; a copy sent to another broker group meanwhile would be delivered
a second time, after its consumers acknowledged the first (found by the fault campaign,
network scenario: a delay server cut off, then healed, turned read-only)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from test_delay_slaves import meta_args

from qmq.aio import Producer
from qmq.cli.admin import ask_every_broker
from qmq.client.routing import pick_group
from qmq.common.errors import SendError
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

SUBJECT = "delay.stays"
FAST = ["--heartbeat-interval-ms", "300", "--slave-timeout-ms", "2000", "--checkpoint-interval-ms", "500"]
DUE_IN_MS = 6_000  # after the send has failed (the slave timeout, then send_timeout_ms)


def _view(meta_server: str) -> dict[str, Any]:
    url = meta_server.removesuffix("/meta/address") + "/meta/cluster"
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def _slave_replicating(meta_server: str, slave: ReadyProcess, timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for s in _view(meta_server)["servers"]:
            if s["address"] == slave.ready["address"] and s["role_in_group"] == "slave" and s["replicated_ms"] > 0:
                return
        time.sleep(0.05)  # polling the meta server's view, bounded by the deadline
    raise AssertionError("the delay slave is not replicating")


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[tuple[str, ReadyProcess]]:
    """A meta server, broker groups b1 and b2, delay group d1 of a master and a slave."""
    with ExitStack() as stack:
        meta = stack.enter_context(running_role(meta_args(tmp_path)))
        url = meta.meta_server
        for group in ("b1", "b2"):
            stack.enter_context(
                running_role(["broker", "--data-dir", str(tmp_path / group), "--meta-server", url, "--group", group,
                              "--heartbeat-interval-ms", "300"])
            )  # fmt: skip
        for role in ("master", "slave"):
            server = stack.enter_context(
                running_role(["delay", "--data-dir", str(tmp_path / f"d1-{role}"), "--meta-server", url,
                              "--group", "d1", "--role", role, *FAST])
            )  # fmt: skip
        _slave_replicating(url, server)
        yield url, server


async def _stored(meta_server: str) -> dict[str, int]:
    """Messages of SUBJECT each broker group has made visible (its LAG answer)."""
    answers = await ask_every_broker(meta_server, RequestCode.LAG, {"subject": SUBJECT, "group": "g"})
    assert all(isinstance(a, dict) for a in answers.values()), answers
    return {name: int(a["messages"]) for name, a in answers.items() if isinstance(a, dict)}


async def test_a_delayed_send_answered_outcome_unknown_never_fails_over_to_a_broker_group(
    cluster: tuple[str, ReadyProcess],
) -> None:
    url, slave = cluster
    pull = {"subject": SUBJECT, "group": "g", "consumer_id": "c", "session": "s", "max": 1, "start": "earliest"}
    await ask_every_broker(url, RequestCode.PULL, pull)  # the group LAG counts for, on both groups
    os.kill(slave.pid, signal.SIGSTOP)  # it copies nothing more: the master turns read-only
    try:
        async with Producer(app_code="t", meta_server=url, send_timeout_ms=3_500) as producer:
            await producer.prepare([SUBJECT])  # it knows the subject's broker groups (it sends there too)
            for _ in range(1_000):  # an id that b2 is picked for: a failover goes to b1 (the first group)
                m = producer.generate_message(SUBJECT)
                if pick_group(("b1", "b2"), m.message_id) == "b2":
                    break
            m.set_delay(DUE_IN_MS / 1000)
            due_ms = m.deliver_at_ms
            with pytest.raises(SendError) as failed:
                await producer.send(m)
            # sent again to d1 only (a broker group, here b1, would refuse it as due too far ahead,
            # or store it when it is nearly due: a second copy)
            assert "from delay group d1" in str(failed.value), failed.value
            assert failed.value.retriable, failed.value
        # the delay master kept its copy: handed over to b2 when due; and nothing else anywhere
        deadline = time.monotonic() + 30
        stored = await _stored(url)
        while time.monotonic() < deadline and not (stored["b2"] and time.time_ns() // 1_000_000 > due_ms + 1_000):
            await asyncio.sleep(0.1)  # polling the brokers until the copy is due and visible, bounded
            stored = await _stored(url)
        assert stored == {"b1": 0, "b2": 1}
    finally:
        os.kill(slave.pid, signal.SIGCONT)
