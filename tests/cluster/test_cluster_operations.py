"""Cluster operations under load, through real processes (`qmq cluster up`, 2 broker groups, each
subject routed to one group unless an operator adds more): a route added and retired while
sends and a consumer run, a drain refused while a subject would be stranded, then done under
load with no failed send and no lost message until the group is empty, and `remove-group`
refused while anything in the group is unconsumed, then allowed; every change in the history."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config, run_qmq

from qmq.aio import Consumer, Producer, PullConsumer
from qmq.cli.admin import ask_every_broker
from qmq.protocol.codes import RequestCode
from qmq.testing.load import Load

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

ORDERS = "ops.orders"  # routed to b1 first, then to b2 too
KEPT = "ops.kept"  # routed to b2 alone: nothing consumes it until the end
KEPT_MESSAGES = 200
# A producer learns of a change at its next refresh (client_refresh_ms = 300 in fast_config) or,
# for a drain, at the broker's first refusal (after its next heartbeat, 300 ms): settled well within.
SETTLE_S = 3.0


def _admin(c: LocalCluster, *args: str) -> str:
    done = run_qmq("admin", *args, "--meta-server", c.meta_server)
    assert done.returncode == 0, f"qmq admin {' '.join(args)} exited {done.returncode}: {done.stderr}"
    return done.stdout


def _refused(c: LocalCluster, *args: str) -> str:
    done = run_qmq("admin", *args, "--meta-server", c.meta_server)
    assert done.returncode != 0, f"qmq admin {' '.join(args)} was not refused: {done.stdout}"
    return done.stderr


def _routes(c: LocalCluster, subject: str) -> dict[str, str]:
    doc = json.loads(_admin(c, "routes", subject, "--json"))
    return {r["group"]: r["state"] for r in doc["routes"]}


async def _counts(meta_server: str, subject: str) -> dict[str, int]:
    # LAG needs a consumer group that pulled there; SUBJECTS lists every subject's count instead
    answers = await ask_every_broker(meta_server, RequestCode.SUBJECTS, {})
    out: dict[str, int] = {}
    for name, a in answers.items():
        assert isinstance(a, dict), f"{name}: {a}"
        out[name] = sum(int(s["messages"]) for s in a["subjects"] if s["subject"] == subject)
    return out


async def _take_all(pull: PullConsumer, n: int, timeout_s: float = 60.0) -> set[str]:
    got: set[str] = set()
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    while len(got) < n:
        assert loop.time() < deadline, f"{len(got)} of {n} messages came"
        batch = await pull.pull(max_messages=500, timeout_ms=500)
        batch.ack_all()
        got.update(m.message_id for m in batch)
    return got


def _operation(group: str, state: str) -> Callable[[dict[str, Any]], bool]:
    return lambda v: any(g["group"] == group and g.get("operation") == state for g in v["groups"])


async def test_routes_drain_and_remove_group_under_load(tmp_path: Path) -> None:
    config = fast_config(tmp_path / "fast.toml", {"meta": {"route_groups": 1}})
    args = ["--broker-groups", "2", "--slaves", "0", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, config) as c:
        # Routed at their first lookup to the group with fewest subjects: ORDERS to b1, KEPT to b2.
        assert _routes(c, ORDERS) == {"b1": "active"}
        assert _routes(c, KEPT) == {"b2": "active"}
        out = _admin(c, "routes", ORDERS, "--add", "b2")
        assert "route-add" in out
        assert "b2" in out
        assert _routes(c, ORDERS) == {"b1": "active", "b2": "active"}
        refused = _refused(c, "routes", ORDERS, "--add", "b2")
        assert "already" in refused

        async with (
            Producer(app_code="ops", meta_server=c.meta_server, retry_backoff_ms=20) as producer,
            Consumer(app_code="billing", meta_server=c.meta_server, consumer_id="billing-1") as consumer,
        ):
            kept = [producer.generate_message(KEPT) for _ in range(KEPT_MESSAGES)]
            await asyncio.gather(*(producer.send(m) for m in kept))
            assert (await _counts(c.meta_server, KEPT))["b2"] == KEPT_MESSAGES

            load = Load(producer, consumer.pull_consumer(ORDERS, "billing", start_from="earliest"), ORDERS)
            load.start()
            await load.until_acked(1_000)

            # Retire ORDERS' route to b1: sends go to b2 alone, the consumer still takes b1's.
            await asyncio.to_thread(_admin, c, "routes", ORDERS, "--remove", "b1")
            assert _routes(c, ORDERS) == {"b1": "retiring", "b2": "active"}
            await asyncio.sleep(SETTLE_S)  # let every producer refresh: the behaviour after it is what is checked
            before = await _counts(c.meta_server, ORDERS)
            await load.until_acked(len(load.record.acked) + 1_000)
            after = await _counts(c.meta_server, ORDERS)
            assert after["b1"] == before["b1"], f"b1 still takes sends of {ORDERS}: {before} -> {after}"
            assert after["b2"] > before["b2"]
            await asyncio.to_thread(_admin, c, "routes", ORDERS, "--add", "b1")  # back: both take sends
            assert _routes(c, ORDERS) == {"b1": "active", "b2": "active"}

            # b2 cannot be drained while KEPT is routed to it alone...
            refused = await asyncio.to_thread(_refused, c, "drain", "b2")
            assert KEPT in refused
            assert "--add" in refused
            await asyncio.to_thread(_admin, c, "routes", KEPT, "--add", "b1")
            # ...and can once KEPT has another group: sends move to b1 at once, none fails.
            out = await asyncio.to_thread(_admin, c, "drain", "b2")
            assert "draining" in out
            await asyncio.to_thread(c.wait_view, "b2 draining", _operation("b2", "draining"))
            await asyncio.sleep(SETTLE_S)
            before = await _counts(c.meta_server, ORDERS)
            await load.until_acked(len(load.record.acked) + 1_000)
            after = await _counts(c.meta_server, ORDERS)
            assert after["b2"] == before["b2"], f"b2 still takes sends while draining: {before} -> {after}"
            await load.stop()
            assert not load.record.failed, f"{len(load.record.failed)} sends failed, e.g. {load.record.failed[0]}"
            lost = load.record.acked.keys() - load.record.received
            assert not lost, f"{len(lost)} acknowledged messages never came to the consumer group"

            # b2 still holds KEPT, which no consumer group has taken: removal is refused, naming it.
            refused = await asyncio.to_thread(_refused, c, "remove-group", "b2")
            assert KEPT in refused, refused
            assert "unconsumed" in refused, refused
            status = run_qmq("cluster", "status", "--meta-server", c.meta_server)
            assert status.returncode == 0, status.stderr
            assert "draining" in status.stdout
            assert "left" in status.stdout

            # A consumer group takes KEPT: b2 empties, shows drained, and can be removed.
            kept_pull = consumer.pull_consumer(KEPT, "kept", start_from="earliest")
            assert await _take_all(kept_pull, KEPT_MESSAGES) == {m.message_id for m in kept}
            await consumer.flush_acks()
            await asyncio.to_thread(c.wait_view, "b2 drained", _operation("b2", "drained"))
        status = run_qmq("cluster", "status", "--meta-server", c.meta_server)
        assert "drained" in status.stdout, status.stdout
        out = _admin(c, "remove-group", "b2")
        assert "removed" in out
        view = c.wait_view("b2 gone", lambda v: all(g["group"] != "b2" for g in v["groups"]))
        assert [r["group"] for r in view["removed_groups"]] == ["b2"]
        # b2's process still runs and heartbeats: it is refused, never registered again.
        c.wait_view("b2's server refused", lambda v: all(s["group"] != "b2" for s in v["servers"]), timeout_s=5)
        assert _routes(c, KEPT) == {"b1": "active"}
        refused = _refused(c, "drain", "b2")
        assert "b2" in refused

        doc = json.loads(_admin(c, "history", "--json"))
        actions = [(e["action"], e["target"]) for e in doc["history"]]
        assert actions == [
            ("route-add", f"{ORDERS} b2"),
            ("route-remove", f"{ORDERS} b1"),
            ("route-add", f"{ORDERS} b1"),
            ("route-add", f"{KEPT} b1"),
            ("drain", "b2"),
            ("remove-group", "b2"),
        ]
        assert all("@" in e["who"] and e["at_ms"] > 0 for e in doc["history"])
