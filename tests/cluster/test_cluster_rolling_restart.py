"""`qmq cluster rolling-restart` under a steady send and consume load, on a cluster started by
`qmq cluster up` (2 broker groups of a master and a slave, a delay group): every process is
restarted (new pids), no send fails, no acknowledged message is lost, and sends go on
throughout. The figure (largest send gap, messages in flight) comes from
`bench/cluster_rolling_restart.py`."""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config, run_qmq

from qmq.aio import Consumer, Producer
from qmq.cli.cluster_launch import Cluster, Member
from qmq.testing.load import Load

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(420)]

SUBJECT = "rolling.orders"
LATER = "rolling.reminders"  # sent due 1.5 s later: through the delay group, master and slave
# The promise: no send held up longer than this while a process restarts.
SEND_GAP_S_MAX = 2.0
# Delayed sends go to the one delay group, acknowledged once its slave has them: they wait while
# that slave restarts (2-3 s in bench/cluster_rolling_restart.py; a promotion, 0.3 s). Below
# slave_timeout_ms (10 s), past which the group would turn read-only and sends fail.
DELAY_SEND_GAP_S_MAX = 8.0
# The rolling restart promotes each slave itself; the meta server's own promotion of a slave whose
# master is silent past heartbeat_timeout_ms is not what this test is about. With fast_config's
# 2 s, a master held off the CPU for 2 s (two test workers on two cores, the other one running
# Spark's JVMs, say) could be replaced behind the restart's back: a group in another epoch than
# the one asserted, a step waiting on a master that had moved. Heartbeats still go every 300 ms.
HEARTBEAT_TIMEOUT_MS = 10_000


async def test_a_rolling_restart_under_load_loses_nothing_and_restarts_every_process(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "1"]
    config = fast_config(tmp_path / "fast.toml", {"meta": {"heartbeat_timeout_ms": HEARTBEAT_TIMEOUT_MS}})
    with cluster_up(data_dir, args, config) as c:
        await asyncio.to_thread(
            c.wait_view,
            "every slave replicating (two broker groups' and the delay group's)",
            lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 3,
        )
        before = {m.name: m.pid for m in c.file().members}
        async with (
            Producer(app_code="load", meta_server=c.meta_server, retry_backoff_ms=20) as producer,
            Consumer(app_code="billing", meta_server=c.meta_server, consumer_id="billing-1") as consumer,
        ):
            load = Load(producer, consumer.pull_consumer(SUBJECT, "billing", start_from="earliest"), SUBJECT)
            later = Load(
                producer,
                consumer.pull_consumer(LATER, "billing", start_from="earliest"),
                LATER,
                senders=1,
                send_every_s=0.005,
                delay_ms=1_500,
            )
            load.start()
            later.start()
            await load.until_acked(1_000)
            await later.until_acked(100)
            loop = asyncio.get_running_loop()
            began = loop.time()
            proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "qmq",
                "cluster",
                "rolling-restart",
                "--data-dir",
                str(data_dir),
                "--json",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            out, err = await proc.communicate()
            ended = loop.time()
            assert proc.returncode == 0, f"rolling-restart exited {proc.returncode}: {err.decode()}"
            await load.until_acked(len(load.record.acked) + 1_000)  # the restarted cluster takes sends
            await later.until_acked(len(later.record.acked) + 100)
            await load.stop()
            await later.stop()

        r = load.record
        assert not r.failed, f"{len(r.failed)} sends failed, e.g. {r.failed[0]}"
        lost = r.acked.keys() - r.received
        assert not lost, f"{len(lost)} acknowledged messages never came to the consumer group"
        gap_s = r.largest_gap_s(began, ended)
        assert gap_s < SEND_GAP_S_MAX, f"no send was acknowledged for {gap_s:.2f} s during the rolling restart"
        # delay sends: the delay group's slave restarted first, then promoted before its master restarted
        d = later.record
        assert not d.failed, f"{len(d.failed)} delay sends failed, e.g. {d.failed[0]}"
        lost = d.acked.keys() - d.received
        assert not lost, f"{len(lost)} acknowledged delay messages never came to the consumer group"
        gap_s = d.largest_gap_s(began, ended)
        assert gap_s < DELAY_SEND_GAP_S_MAX, f"no delay send was acknowledged for {gap_s:.2f} s during the restart"

        report = json.loads(out)
        names = [x["name"] for x in report["restarted"]]
        # slaves first (the broker groups' and the delay group's), then each master (its slave
        # promoted first), the meta server last
        assert names == ["b1-s1", "b2-s1", "d1-s1", "b1-m", "b2-m", "d1", "meta"], names
        [d1] = [x for x in report["restarted"] if x["name"] == "d1"]
        assert (d1["before"], d1["after"]) == ("master", "slave"), d1
        assert "promoted first" in d1["how"], d1
        after = {m.name: m.pid for m in c.file().members}
        assert set(after) == set(before)
        assert all(after[n] != before[n] for n in before), f"not every pid changed: {before} -> {after}"
        assert {x["name"]: x["new_pid"] for x in report["restarted"]} == after
        view = c.view()
        # the old masters came back as slaves of the new epoch; every server heartbeats, each address once
        assert sorted((g["group"], g["epoch"]) for g in view["groups"] if g["role"] in ("broker", "delay")) == [
            ("b1", 2),
            ("b2", 2),
            ("d1", 2),
        ]
        assert {s["pid"] for s in view["servers"] if s["state"] == "available"} == set(after.values()) - {after["meta"]}
        assert len(view["servers"]) == len(after) - 1, "a restarted server left a row behind at an old address"


def test_a_rolling_restart_is_refused_while_a_process_of_the_cluster_is_not_running(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    data_dir.mkdir()
    gone = Member("b1-m", "broker", "b1", "master", str(data_dir / "b1-m"), ["qmq", "broker"], str(tmp_path / "b1.log"))
    Cluster(str(data_dir), "http://127.0.0.1:9/meta/address", [gone], 0).save()
    done = run_qmq("cluster", "rolling-restart", "--data-dir", str(data_dir))
    assert done.returncode == 1, done.stdout
    assert "b1-m of" in done.stderr
    assert "not running" in done.stderr
    assert "start what is missing" in done.stderr
