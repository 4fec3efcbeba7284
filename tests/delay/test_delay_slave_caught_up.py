"""The caught-up rule (serving/replication.py, issue 24) with real processes: a delay master with
no slave answers sends alone; a slave that starts then must copy them before the meta server
counts it as replicating. While its copy is short of what its master answered (held there by a
fault plan failing its write-ahead log's second segment, QMQ_FAULT_PLAN) it reports no
replicated_ms, and the meta server promotes it neither by hand nor when the master is killed;
once caught up, a kill -9 of the master promotes it and every acknowledged message comes."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest
from delaywire import collect, now_ms
from test_delay_slaves import (
    GROUP,
    cluster_view,
    delay_args,
    delay_group_row,
    delay_server,
    meta_args,
    pending,
    wait_view,
)

from qmq.aio import Consumer, Producer
from qmq.testing import ReadyProcess, running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SUBJECT = "slaves.caughtup"
SEGMENT_BYTES = 65536
# small write-ahead log segments: the slave's first answer is the master's first segment only;
# no checkpoint while the test runs: the master alone would delete the log its slave must copy
MASTER_OPTIONS = ["--wal-segment-bytes", str(SEGMENT_BYTES), "--checkpoint-interval-ms", "600000"]
BODY = b"x" * 1000
N = 200  # ~220 KB
ROUNDS = 4
# due after the last kill of the master (~7 s after the sends here, with two other tests running)
DUE_AFTER_MS = 15_000


def _plan(path: Path, *rules: dict[str, Any]) -> dict[str, str]:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(list(rules)))
    os.replace(tmp, path)  # whole, for a server that may be reading it
    return {"QMQ_FAULT_PLAN": str(path)}


def _promote_by_hand(meta_server: str) -> tuple[int, dict[str, Any]]:
    url = meta_server.removesuffix("/meta/address") + "/meta/promote"
    body = json.dumps({"group": GROUP, "role": "delay", "by": "test"}).encode()
    req = urllib.request.Request(url, body, {"Content-Type": "application/json"}, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=5) as resp:
            return resp.status, json.load(resp)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def _row(meta_server: str, proc: ReadyProcess) -> dict[str, Any]:
    row = delay_server(cluster_view(meta_server), proc.ready["address"])
    assert row is not None, f"the meta server lists no delay server {proc.ready['address']}"
    return row


async def _send(producer: Producer, due_ms: float) -> list[str]:
    """``N`` messages, in rounds of ~55 KB one after the other: the master's log rolls to a new
    segment every round (a producer's frame is written whole to one segment)."""
    ids: list[str] = []
    for _ in range(ROUNDS):
        futures = []
        for _ in range(N // ROUNDS):
            m = producer.generate_message(SUBJECT)
            m.body = BODY
            m.set_deliver_at(due_ms / 1000)
            ids.append(m.message_id)
            futures.append(producer.send_nowait(m))
        await asyncio.gather(*futures)
    return ids


async def test_a_slave_is_promotable_only_once_it_holds_what_its_master_answered_alone(tmp_path: Path) -> None:
    plan = tmp_path / "slave-faults.json"
    slave_dir = tmp_path / "d1-s"
    # the slave's copy stops at the master's second segment: writing its header fails (the
    # first segment, 00000000000000000000.log, has no digit but 0)
    hold = {"op": "write", "path": f"{slave_dir.resolve()}/wal/*[1-9]*.log", "errno": "EIO"}
    with ExitStack() as stack:
        meta = stack.enter_context(running_role(meta_args(tmp_path)))
        url = meta.meta_server
        stack.enter_context(
            running_role(["broker", "--data-dir", str(tmp_path / "b1"), "--meta-server", url, "--group", "b1",
                          "--heartbeat-interval-ms", "300"])
        )  # fmt: skip
        master_args = [*delay_args(tmp_path / "d1-m", url, "master"), *MASTER_OPTIONS]
        master = stack.enter_context(running_role(master_args))
        async with (
            Producer(app_code="t", meta_server=url) as producer,
            Consumer(app_code="t", meta_server=url, consumer_id="c1") as consumer,
        ):
            pull = consumer.pull_consumer(SUBJECT, "billing", start_from="earliest")

            # 1. the master, with no slave, answers every send alone
            due_ms = now_ms() + DUE_AFTER_MS
            ids = await _send(producer, due_ms)
            sent_ms = now_ms()

            def reported_all(v: dict[str, Any]) -> bool:
                m = delay_server(v, master.ready["address"])
                return m is not None and m["last_heartbeat_ms"] > sent_ms

            wait_view(url, "the master reporting its log after the sends", reported_all)
            view = cluster_view(url)
            row = delay_group_row(view)
            assert (row["slaves"], row["write_state"], row["epoch"]) == (0, "ok", 1), row
            master_end = _row(url, master)["log_end"]
            assert master_end > 3 * SEGMENT_BYTES

            # 2. a slave starts; its copy is held after the master's first segment
            slave_args = [*delay_args(slave_dir, url, "slave"), "--wal-segment-bytes", str(SEGMENT_BYTES)]
            slave = stack.enter_context(running_role(slave_args, env=_plan(plan, hold)))

            def copying(v: dict[str, Any]) -> bool:
                s = delay_server(v, slave.ready["address"])
                return s is not None and s["reported_role_in_group"] == "slave" and s["log_end"] > 0

            wait_view(url, "the slave copying the master's first segment", copying)
            held = _row(url, slave)
            assert 0 < held["log_end"] <= SEGMENT_BYTES < master_end, held
            # the report that says it copied part says it does not hold what its master answered
            assert held["replicated_ms"] == 0, (
                f"a slave holding {held['log_end']} of the {master_end} bytes its master answered alone "
                f"reports replicated_ms {held['replicated_ms']}: the meta server may promote it"
            )
            status, answer = _promote_by_hand(url)
            assert status == 409, answer
            assert "last held every write its master had answered never" in answer["error"], answer

            os.kill(master.pid, signal.SIGKILL)
            master.proc.wait()
            last_heard = _row(url, master)["last_heartbeat_ms"]

            def silent_a_while(v: dict[str, Any]) -> bool:
                # two promotion checks (every 500 ms) past the heartbeat timeout
                return bool(v["time_ms"] - last_heard > 3_000)

            wait_view(url, "the master silent past the heartbeat timeout", silent_a_while)
            view = cluster_view(url)
            row = delay_group_row(view)
            assert (row["master"], row["epoch"], row["state"]) == (master.ready["address"], 1, "unavailable"), row
            still = delay_server(view, slave.ready["address"])
            assert still is not None
            assert (still["log_end"], still["replicated_ms"]) == (held["log_end"], 0), still
            status, answer = _promote_by_hand(url)
            assert status == 409, answer
            assert "last held every write its master had answered never" in answer["error"], answer

            # 3. the master back on its data, the slave's disk well again: it catches up
            master = stack.enter_context(running_role(master_args))
            _plan(plan)

            def caught_up(v: dict[str, Any]) -> bool:
                s, m = delay_server(v, slave.ready["address"]), delay_server(v, master.ready["address"])
                return (
                    delay_group_row(v)["master"] == master.ready["address"]
                    and s is not None
                    and m is not None
                    and s["epoch"] == 1
                    and s["log_end"] == m["log_end"] == master_end
                    and s["replicated_ms"] > 0
                )

            wait_view(url, "the slave catching up with the restarted master", caught_up)
            assert await pending(slave.ready["address"]) == N
            assert await pending(master.ready["address"]) == N, "a message came due before the kill: raise DUE_AFTER_MS"

            os.kill(master.pid, signal.SIGKILL)
            master.proc.wait()

            def promoted(v: dict[str, Any]) -> bool:
                row = delay_group_row(v)
                return (row["master"], row["epoch"]) == (slave.ready["address"], 2)

            wait_view(url, "the slave promoted", promoted)
            left_s = (due_ms - now_ms()) / 1000
            got = await collect(pull, N, timeout_s=left_s + 30)
            assert set(got) == set(ids), f"{len(set(ids) - set(got))} of {N} acknowledged messages were lost"
            early = [i for i, at in got.items() if at < due_ms - 5]
            assert not early, f"{len(early)} messages came early"
            assert not await collect(pull, 1, timeout_s=1), "a message came twice"
