"""A master whose slave is gone: read-only after slave_timeout_ms (producers go to other
groups), or, with degrade_unreplicated, writing alone (what it then takes is stored and read back)
— and `qmq cluster status` says which."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config, run_qmq

from qmq.client.sync import Consumer, Producer, PullConsumer
from qmq.common.errors import SendError

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def _pull_ids(pull: PullConsumer, count: int, timeout_s: float = 20.0) -> list[str]:
    """Ids of the first ``count`` messages pulled (and acknowledged), in the order received."""
    got: list[str] = []
    deadline = time.monotonic() + timeout_s
    while len(got) < count:
        assert time.monotonic() < deadline, f"only {got} of {count} messages came within {timeout_s} s"
        batch = pull.pull(max_messages=count, timeout_ms=500)
        batch.ack_all()
        got.extend(m.message_id for m in batch)
    return got


def _kill_slave(c: object) -> None:
    member = c.member("b1-s1")  # type: ignore[attr-defined]
    os.kill(member.pid, signal.SIGKILL)


@pytest.mark.parametrize(("degrade", "state"), [(False, "read-only"), (True, "degraded")])
def test_a_master_without_its_slave(tmp_path: Path, degrade: bool, state: str) -> None:
    config = fast_config(tmp_path / "fast.toml", {"broker": {"degrade_unreplicated": degrade}})
    args = ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, config) as c:
        c.wait_view("the slave replicating", lambda v: any(s["replicated_ms"] for s in v["servers"]))
        with Producer(app_code="shop", meta_server=c.meta_server, send_timeout_ms=1500) as producer:
            replicated = producer.generate_message("ws.s")
            producer.send(replicated)  # acknowledged once the slave has it
            _kill_slave(c)
            c.wait_view(f"the group {state}", lambda v: v["groups"][0]["write_state"] == state, timeout_s=30)
            alone = producer.generate_message("ws.s")
            if degrade:
                producer.send(alone)
                # stored on the master alone, and there to read: both sends come back, in order
                with Consumer(app_code="audit", meta_server=c.meta_server) as consumer:
                    pull = consumer.pull_consumer("ws.s", "audit", start_from="earliest")
                    got = _pull_ids(pull, 2)
                assert got == [replicated.message_id, alone.message_id]
            else:
                with pytest.raises(SendError, match="read-only"):
                    producer.send(alone)
        status = run_qmq("cluster", "status", "--data-dir", str(tmp_path / "cluster"))
        assert status.returncode == 0, status.stderr
        assert state in status.stdout
