"""`qmq cluster up|status|down` and `qmq admin promote` end to end: 2 broker groups of a master
and a slave plus a delay group, every role its own process (visible in ps with its group, role
and data directory), one ready line, a status listing everything, a promotion by hand, and a
down that stops them all."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config, run_qmq

from qmq import Producer
from qmq.cli.cluster_launch import Cluster, Member, is_running, start_ticks

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

NAMES = ["meta", "b1-m", "b2-m", "d1", "b1-s1", "b2-s1", "d1-s1"]


def _ps_args(pid: int) -> str:
    return subprocess.run(
        ["ps", "-ww", "-o", "args=", "-p", str(pid)], capture_output=True, text=True, check=True
    ).stdout


def _wait_all_gone(pids: list[int], timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while any(start_ticks(p) is not None for p in pids):
        assert time.monotonic() < deadline, f"still running: {[p for p in pids if start_ticks(p) is not None]}"
        time.sleep(0.05)  # polling pids for exit, bounded by the deadline


def _slaves_replicating(c: LocalCluster) -> None:
    """Wait until each slave follows its master in epoch 1 and has heard from it."""
    c.wait_view(
        "every slave replicating",
        lambda v: (
            sorted(
                s["group"]
                for s in v["servers"]
                if s["role_in_group"] == "slave" and s["epoch"] == 1 and s["replicated_ms"] > 0
            )
            == ["b1", "b2", "d1"]
        ),
    )


def test_up_status_promote_down(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    config = fast_config(tmp_path / "fast.toml")
    with cluster_up(data_dir, ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "1"], config) as c:
        ready = c.ready
        assert ready["meta_server"].startswith("http://127.0.0.1:")
        assert ready["meta_server"].endswith("/meta/address")
        assert (ready["broker_groups"], ready["slaves_per_group"], ready["delay_groups"]) == ("b1,b2", "1", "d1")
        assert (ready["processes"], ready["data_dir"]) == ("7", str(data_dir.resolve()))
        assert ready["console"] == ready["meta_server"].removesuffix("/meta/address") + "/console/"

        state = c.file()
        assert state.meta_server == ready["meta_server"]
        assert [m.name for m in state.members] == NAMES
        for m in state.members:
            assert is_running(m), f"{m.name} (pid {m.pid}) is not running"
            args = _ps_args(m.pid)
            assert f"--data-dir {data_dir.resolve() / m.name}" in args
            assert f"--config {config}" in args
            if m.role != "meta":
                assert f"qmq {m.role} --group {m.group}" in args
                assert f"--meta-server {ready['meta_server']}" in args
            if m.role in ("broker", "delay"):
                assert f"--role {m.role_in_group}" in args
            # Detached: its own session, so it outlived `cluster up` and ignores the terminal's Ctrl-C.
            assert os.getsid(m.pid) == m.pid
            # It logs to its own rotated file; its stdout (the ready line) goes beside it.
            assert m.log == str(data_dir.resolve() / "logs" / f"{m.name}.log")
            assert Path(m.log).is_file()
            assert "qmq ready" in Path(m.log).with_suffix(".out").read_text()

        # A second `up` on a running cluster is refused, naming what runs.
        again = run_qmq("cluster", "up", "--data-dir", str(data_dir))
        assert again.returncode == 3
        assert "is running (meta pid" in again.stderr
        assert f"qmq cluster down --data-dir {data_dir}" in again.stderr

        # Something to route, then the status.
        with Producer(app_code="t", meta_server=c.meta_server) as producer:
            producer.send(producer.generate_message("cluster.s"))
        _slaves_replicating(c)
        view = json.loads(run_qmq("cluster", "status", "--data-dir", str(data_dir), "--json").stdout)
        pids = {m.name: m.pid for m in state.members}
        servers = {s["pid"]: s for s in view["servers"]}
        assert set(servers) == {pids[n] for n in NAMES[1:]}
        for name in NAMES[1:]:
            m = c.member(name)
            s = servers[m.pid]
            assert (s["role"], s["group"], s["state"], s["address"]) == (
                m.role,
                m.group,
                "available",
                m.ready["address"],
            )
            assert s["role_in_group"] == (m.role_in_group or "master")
        groups = {g["group"]: g for g in view["groups"]}
        assert {g: (groups[g]["epoch"], groups[g]["master"]) for g in groups} == {
            "b1": (1, c.member("b1-m").ready["address"]),
            "b2": (1, c.member("b2-m").ready["address"]),
            "d1": (1, c.member("d1").ready["address"]),
        }
        assert view["routes"] == {"cluster.s": ["b1", "b2"]}
        assert view["meta"]["leading"] is True

        text = run_qmq("cluster", "status", "--data-dir", str(data_dir))
        assert text.returncode == 0, text.stderr
        for word in ["b1-m", "b1-s1", "b2-m", "b2-s1", "d1", "d1-s1", "cluster.s", "epoch", "lag", "available"]:
            assert word in text.stdout
        # the delay slave: its role in its group, the group's epoch and its replication lag
        delay_slave = servers[pids["d1-s1"]]
        assert (delay_slave["role_in_group"], delay_slave["epoch"]) == ("slave", 1)
        assert delay_slave["lag"] is not None
        assert delay_slave["replicated_ms"] > 0
        [row] = [line for line in text.stdout.splitlines() if "d1-s1" in line]
        assert "slave" in row, row
        by_url = run_qmq("cluster", "status", "--meta-server", c.meta_server, "--json")
        assert {s["pid"] for s in json.loads(by_url.stdout)["servers"]} == set(servers)

        # A promotion by hand: b1's slave is master in epoch 2, its old master follows it.
        promoted = run_qmq("admin", "promote", "b1", "--meta-server", c.meta_server)
        assert promoted.returncode == 0, promoted.stderr
        slave = c.member("b1-s1").ready["address"]
        assert f"promoted {slave} to master of broker group b1 in epoch 2" in promoted.stdout
        c.wait_view(
            "b1's old master following in epoch 2",
            lambda v: any(
                s["pid"] == pids["b1-m"] and s["reported_role_in_group"] == "slave" and s["epoch"] == 2
                for s in v["servers"]
            ),
        )
        refused = run_qmq("admin", "promote", "b9", "--meta-server", c.meta_server)
        assert refused.returncode == 1
        assert "no broker group 'b9' has registered" in refused.stderr

        down = run_qmq("cluster", "down", "--data-dir", str(data_dir))
        assert down.returncode == 0, down.stderr
        assert f"stopped 7 process(es) of {data_dir.resolve()}" in down.stdout
        order = [line.split()[1] for line in down.stdout.splitlines()[:-1]]
        assert order[-1] == "meta"  # the meta server last
        _wait_all_gone(list(pids.values()))
        assert not (data_dir / "cluster.json").exists()

    again = run_qmq("cluster", "down", "--data-dir", str(data_dir))
    assert again.returncode == 1
    assert "no cluster.json" in again.stderr


def test_a_startup_failure_stops_what_was_started_and_exits_3(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        done = run_qmq("cluster", "up", "--data-dir", str(data_dir), "--meta-port", str(port))
    assert done.returncode == 3
    [line] = done.stderr.splitlines()
    assert line.startswith("qmq cluster: cannot start: meta (qmq meta) exited with status 3 before it was ready")
    assert f"cannot listen on 127.0.0.1:{port}: the port is in use" in line
    assert not (data_dir / "cluster.json").exists()


def test_a_cluster_file_of_dead_processes_does_not_block_a_new_cluster(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    data_dir.mkdir()
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone = Member("meta", "meta", None, None, str(data_dir / "meta"), ["true"], str(data_dir / "x.log"), dead.pid, 1)
    Cluster(str(data_dir), "http://127.0.0.1:1/meta/address", [gone], 0).save()
    assert not is_running(Cluster.load(data_dir).members[0])
    with cluster_up(data_dir, ["--broker-groups", "1", "--slaves", "0", "--delay-groups", "0"]) as c:
        assert [m.name for m in c.file().members] == ["meta", "b1-m"]
