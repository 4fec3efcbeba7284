"""A push subscription taken over after `kill -9` of the gateway process running it: another
gateway takes its lease within seconds and delivers everything, including what the dead one
had pulled and not acknowledged; nothing is lost."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import uuid
from contextlib import ExitStack
from pathlib import Path

import pytest
from pushhelpers import Delivery, push_add, qmq_push, running_receiver

from qmq.aio import Producer
from qmq.testing import running_gateway, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

# The gateway's lease (6 s) and renewal period (2 s), with room for a loaded machine.
TAKEOVER_S_MAX = 60.0


def _holder(meta_server: str, subject: str) -> str | None:
    listed = qmq_push("list", "--json", meta_server=meta_server)
    assert listed.returncode == 0, listed.stderr
    for s in json.loads(listed.stdout)["subscriptions"]:
        if s["subject"] == subject and s["leased"]:
            return str(s["owner"])
    return None


def _pid_of(owner: str) -> int:
    """The process id in a gateway's lease owner name, ``<host>-gateway-<pid>-<random>``: the
    standalone's gateway or one of the two started here, whichever took the lease first."""
    return int(owner.rsplit("-gateway-", 1)[1].split("-")[0])


async def _wait_holder(meta_server: str, subject: str, other_than: str | None = None) -> str:
    deadline = time.monotonic() + TAKEOVER_S_MAX
    while True:
        owner = await asyncio.to_thread(_holder, meta_server, subject)
        if owner is not None and owner != other_than:
            return owner
        assert time.monotonic() < deadline, f"no gateway but {other_than} held the lease after {TAKEOVER_S_MAX} s"
        await asyncio.sleep(0.2)  # polling the meta server, bounded by the deadline


async def test_kill_9_of_the_gateway_running_a_subscription_loses_nothing(tmp_path: Path) -> None:
    subject, group = f"test.{uuid.uuid4().hex[:12]}", "takeover"
    killed_at: list[float] = []
    held: list[Delivery] = []
    release = asyncio.Event()

    async def answer(d: Delivery) -> int:
        if not killed_at and len(held) < 4 and int(d.doc["body"].split("-")[1]) >= 10:
            # the second batch: hold a few deliveries open until the gateway is killed, so it dies
            # with messages pulled and not acknowledged
            held.append(d)
            await release.wait()
            return 503  # its gateway is dead: nobody reads this answer
        return 200

    with ExitStack() as stack:
        standalone = stack.enter_context(running_standalone(tmp_path / "qmq-data"))
        meta_server = standalone.meta_server
        for _ in range(2):
            stack.enter_context(running_gateway(meta_server))
        async with running_receiver(answer) as rx, Producer(app_code="shop", meta_server=meta_server) as producer:
            push_add(subject, group, rx.url, "--concurrency", "4", meta_server=meta_server)

            async def send(first: int, n: int) -> list[str]:
                messages = []
                for i in range(first, first + n):
                    m = producer.generate_message(subject)
                    m.body = f"m-{i}"
                    messages.append(m)
                await asyncio.gather(*(producer.send(m) for m in messages))
                return [m.message_id for m in messages]

            sent = await send(0, 10)
            await rx.wait_until("the first ten", lambda: {d.message_id for d in rx.ok()} >= set(sent))
            owner = await _wait_holder(meta_server, subject)
            pid = _pid_of(owner)

            sent += await send(10, 30)
            await rx.wait_until("four deliveries held open", lambda: len(held) == 4)
            os.kill(pid, signal.SIGKILL)
            killed_at.append(time.monotonic())
            release.set()
            await _wait_holder(meta_server, subject, other_than=owner)
            await rx.wait_until(
                "every message delivered", lambda: {d.message_id for d in rx.ok()} >= set(sent), TAKEOVER_S_MAX
            )
    ok_ids = [d.message_id for d in rx.ok()]
    assert set(ok_ids) == set(sent)
    held_ids = {d.message_id for d in held}
    assert held_ids <= set(ok_ids)  # pulled by the dead gateway, delivered by the one that took over
