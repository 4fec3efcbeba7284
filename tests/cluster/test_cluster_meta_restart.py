"""kill -9 of the meta server of a cluster started by `qmq cluster up` on a fixed port: sends go on
meanwhile (clients keep the last answer), and once it is back every route, group and epoch is
as before and the brokers heartbeat to it again."""

from __future__ import annotations

import os
import signal
import socket
import time
import urllib.request
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config, run_qmq

from qmq import Producer
from qmq.cli.cluster_launch import child_env, start

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_meta_server_restart_loses_no_route_group_or_epoch(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    args = ["--broker-groups", "2", "--slaves", "0", "--delay-groups", "0", "--meta-port", str(_free_port())]
    with cluster_up(data_dir, args, fast_config(tmp_path / "fast.toml")) as c:
        subjects = [f"restart.s{i}" for i in range(4)]
        with Producer(app_code="t", meta_server=c.meta_server) as producer:
            for s in subjects:
                producer.send(producer.generate_message(s))
            before = c.view()
            assert set(before["routes"]) == set(subjects)

            state = c.file()
            [meta] = [m for m in state.members if m.name == "meta"]
            os.kill(meta.pid, signal.SIGKILL)
            deadline = time.monotonic() + 10
            while _answers(c.base_url):
                assert time.monotonic() < deadline, "the meta server still answers after kill -9"
                time.sleep(0.05)  # polling for the kill to take effect, bounded by the deadline
            # No meta server: the status says so, and lists the processes started here.
            status = run_qmq("cluster", "status", "--data-dir", str(data_dir))
            assert status.returncode == 1
            assert "cannot reach the meta server" in status.stderr
            assert "processes of" in status.stdout
            assert "b2-m" in status.stdout
            # ...and the producer still knows where each subject goes.
            for s in subjects:
                producer.send(producer.generate_message(s))

            restarted = start(meta, child_env("WARNING"))
            try:
                state.save()  # so `cluster down` stops the new one
                after = c.wait_view(
                    "both brokers heartbeating to the restarted meta server",
                    lambda v: (
                        [(g["group"], g["state"]) for g in v["groups"]] == [("b1", "available"), ("b2", "available")]
                        and all(s["last_heartbeat_ms"] > v["time_ms"] - 1_000 for s in v["servers"])
                    ),
                )
                assert after["routes"] == before["routes"]
                assert [(g["group"], g["epoch"], g["master"]) for g in after["groups"]] == [
                    (g["group"], g["epoch"], g["master"]) for g in before["groups"]
                ]
                producer.send(producer.generate_message(subjects[0]))
            finally:
                if restarted.poll() is None:
                    restarted.terminate()
                restarted.wait(30)


def _answers(base_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base_url}/health", timeout=1):
            return True
    except OSError:
        return False
