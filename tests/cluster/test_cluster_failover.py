"""kill -9 of a broker group's master in the middle of a steady send load, on a cluster started
by `qmq cluster up` (2 broker groups of a master and a slave): sends carry on within 2 s on the
other group, the meta server promotes the slave and clients send to it, no acknowledged message
is lost or stored twice, a consumer group that had acknowledged messages never receives them
again, and the
old master, restarted, follows the new one and catches up."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config

from qmq.aio import Consumer, Producer, PullConsumer
from qmq.cli.admin import ask_every_broker
from qmq.cli.cluster_launch import child_env, start
from qmq.common.errors import QmqError
from qmq.protocol.codes import RequestCode

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SUBJECT = "failover.orders"
SENDERS = 8
# Each sender sends every SEND_EVERY_S, up to OUTSTANDING_MAX not yet answered (~8,000 msg/s in all).
SEND_EVERY_S = 0.001
OUTSTANDING_MAX = 4_000
RESUME_S_MAX = 2.0
BEFORE_KILL = 2_000  # messages acknowledged before the kill
AFTER_PROMOTION = 2_000  # and after the slave is master


def _b1_promoted(c: LocalCluster) -> dict[str, object]:
    slave = c.member("b1-s1").ready["address"]
    return c.wait_view(
        "b1's slave promoted",
        lambda v: any(g["group"] == "b1" and g["epoch"] == 2 and g["master"] == slave for g in v["groups"]),
    )


async def _drain(pull: PullConsumer, want: set[str], timeout_s: float = 60.0) -> list[str]:
    """Pull (and ack) until every id of ``want`` came; every id received, in order, repeats kept."""
    got: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while not want <= set(got):
        assert loop.time() < deadline, f"{len(want - set(got))} of {len(want)} messages never came"
        try:
            batch = await pull.pull(max_messages=500, timeout_ms=500)
        except QmqError:
            await asyncio.sleep(0.1)  # a broker group is between masters: ask again shortly
            continue
        batch.ack_all()
        got.extend(m.message_id for m in batch)
    return got


async def test_kill_9_of_a_master_mid_load_loses_and_repeats_nothing(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(data_dir, args, fast_config(tmp_path / "fast.toml")) as c:
        await asyncio.to_thread(
            c.wait_view,
            "both slaves replicating",
            lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 2,
        )
        loop = asyncio.get_running_loop()
        acked: dict[str, float] = {}  # message id -> when its send was acknowledged
        failed: list[str] = []
        stop = asyncio.Event()
        reached = asyncio.Event()  # set once len(acked) >= target[0]
        target = [BEFORE_KILL]

        async with (
            Producer(app_code="load", meta_server=c.meta_server, retry_backoff_ms=20) as producer,
            Consumer(app_code="billing", meta_server=c.meta_server, consumer_id="billing-1") as consumer,
        ):
            pull = consumer.pull_consumer(SUBJECT, "billing", start_from="earliest")

            def settled(message_id: str, fut: asyncio.Future[None]) -> None:
                if fut.cancelled() or fut.exception() is not None:
                    failed.append(str(fut.exception()))
                    return
                acked[message_id] = loop.time()
                if len(acked) >= target[0]:
                    reached.set()

            async def sender() -> None:
                # Open-loop load, as a service taking requests has: new sends do not wait for
                # earlier ones. The frame in flight to b1 when it dies waits for its slave's
                # promotion (it may be stored: only b1's duplicate window can drop its repeat);
                # sends made after the kill go to b2 at once.
                outstanding: set[asyncio.Future[None]] = set()
                while not stop.is_set():
                    m = producer.generate_message(SUBJECT)
                    m.body = b"x" * 100
                    fut = producer.send_nowait(m)
                    fut.add_done_callback(functools.partial(settled, m.message_id))
                    outstanding.add(fut)
                    fut.add_done_callback(outstanding.discard)
                    if len(outstanding) >= OUTSTANDING_MAX:
                        await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
                    else:
                        await asyncio.sleep(SEND_EVERY_S)  # the load's pace
                await asyncio.gather(*outstanding, return_exceptions=True)

            senders = [asyncio.ensure_future(sender()) for _ in range(SENDERS)]
            try:
                await asyncio.wait_for(reached.wait(), 60)
                # The group takes what is there and the brokers answer its acks: these were acknowledged.
                confirmed = set(await _drain(pull, set(list(acked)[:BEFORE_KILL]), timeout_s=30))
                await consumer.flush_acks()

                os.kill(c.member("b1-m").pid, signal.SIGKILL)
                killed_at = loop.time()
                await asyncio.to_thread(_b1_promoted, c)
                reached.clear()
                target[0] = len(acked) + AFTER_PROMOTION  # load on the new master too
                await asyncio.wait_for(reached.wait(), 60)
                # Clients move to the new master of b1 (its log grows past where its epoch began)
                # while the load goes on: they may send to b2 alone until they see b1 again.
                await asyncio.to_thread(c.wait_view, "sends to b1's new master", _b1_master_grew)
            finally:
                stop.set()
                await asyncio.gather(*senders)

            assert not failed, f"{len(failed)} sends failed, e.g. {failed[0]}"
            after_kill = sorted(t for t in acked.values() if t > killed_at)
            assert after_kill, "no send was acknowledged after the kill"
            gaps = [b - a for a, b in zip([killed_at, *after_kill], after_kill, strict=False)]
            assert max(gaps) < RESUME_S_MAX, f"sends stopped for {max(gaps):.2f} s around the failover"

            # The group that had acknowledged never gets those again, and misses nothing.
            rest = await _drain(pull, set(acked) - confirmed)
            assert not confirmed & set(rest), f"{len(confirmed & set(rest))} acknowledged messages came again"
            # No acknowledged send is lost: a new group reads every one from both broker groups.
            audit = consumer.pull_consumer(SUBJECT, "audit", start_from="earliest")
            everything = await _drain(audit, set(acked))
            # ...and each exactly once: a send whose answer was lost when b1 died is retried on b1 once
            # its slave is master (not on b2: it would then be in both groups' logs).
            delivered_twice = [mid for mid, n in Counter(everything).items() if n > 1]
            assert not delivered_twice, f"{len(delivered_twice)} messages came twice to a new group"
            stored = await _stored(c.meta_server, SUBJECT, "audit")
            assert sum(stored.values()) == len(acked), (
                f"{len(acked)} sends were acknowledged, the broker groups store {stored}: "
                f"{sum(stored.values()) - len(acked)} stored twice"
            )
        # The old master comes back (same data, new port): it follows the new master in epoch 2
        # and catches up with it.
        state = c.file()
        [old] = [m for m in state.members if m.name == "b1-m"]
        restarted = start(old, child_env("WARNING"))
        try:
            state.save()  # so `cluster down` stops it too
            await asyncio.to_thread(c.wait_view, "b1's old master caught up as a slave", _rejoined(old.pid))
        finally:
            if restarted.poll() is None:
                restarted.terminate()
            restarted.wait(30)


async def _stored(meta_server: str, subject: str, group: str) -> dict[str, int]:
    """Messages of ``subject`` each broker group stores (its LAG answer for ``group``)."""
    answers = await ask_every_broker(meta_server, RequestCode.LAG, {"subject": subject, "group": group})
    assert all(isinstance(a, dict) for a in answers.values()), answers
    return {name: int(a["messages"]) for name, a in answers.items() if isinstance(a, dict)}


def _rejoined(pid: int) -> Callable[[dict[str, Any]], bool]:
    def ok(view: dict[str, Any]) -> bool:
        return any(
            s["pid"] == pid and s["reported_role_in_group"] == "slave" and s["epoch"] == 2 and s["lag"] == 0
            for s in view["servers"]
        )

    return ok


def _b1_master_grew(view: dict[str, Any]) -> bool:
    [b1] = [g for g in view["groups"] if g["group"] == "b1"]
    [master] = [s for s in view["servers"] if s["address"] == b1["master"]]
    return bool(master["log_end"] > b1["message_offset"])
