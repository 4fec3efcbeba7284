"""A pull that hands out messages is answered only once its record — which messages went to
which consumer, by position — is on the slave: a consumer acks by position in that record, so
after a failover that forgot it its acks would not take and it would receive the messages again
after those acks were answered (found by the fault campaign, a master killed right after a pull)."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config

from qmq.aio import Producer
from qmq.client.connection import Connection
from qmq.common.errors import BrokerError
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

SUBJECT = "pull.truth"


def test_a_pull_waits_for_the_slave_and_its_acks_survive_a_failover(tmp_path: Path) -> None:
    args = ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        c.wait_view("the slave replicating", lambda v: any(s["replicated_ms"] for s in v["servers"]))
        asyncio.run(_pull_then_fail_over(c))


async def _pull_then_fail_over(c: LocalCluster) -> None:
    async with Producer(app_code="shop", meta_server=c.meta_server) as producer:
        for _ in range(5):
            await producer.send(producer.generate_message(SUBJECT))
    header: dict[str, Any] = {"subject": SUBJECT, "group": "g", "consumer_id": "c1", "session": "raw", "max": 5}
    master = Connection(c.view()["groups"][0]["master"], connect_timeout_ms=5000)
    slave = c.member("b1-s1")
    try:
        os.kill(slave.pid, signal.SIGSTOP)  # it copies nothing while stopped
        try:
            pull = asyncio.ensure_future(
                master.request(RequestCode.PULL, {**header, "timeout_ms": 0, "start": "earliest"})
            )
            done, _ = await asyncio.wait([pull], timeout=0.5)  # well within slave_timeout_ms (2 s)
            assert not done, "the pull was answered before its record reached the slave"
        finally:
            os.kill(slave.pid, signal.SIGCONT)
        pulled = await asyncio.wait_for(pull, 10)
        assert pulled.status == Status.OK
        assert sum(r[1] for r in pulled.header["runs"]) == 5
    finally:
        await master.close()
    os.kill(c.member("b1-m").pid, signal.SIGKILL)
    address = slave.ready["address"]
    view = await asyncio.to_thread(
        c.wait_view, "the slave promoted", lambda v: v["groups"][0]["master"] == address and v["groups"][0]["epoch"] > 1
    )
    new_master = Connection(view["groups"][0]["master"], connect_timeout_ms=5000)
    try:
        acked = await _as_master(new_master, {**header, "ranges": [[0, 5]]})
        assert acked.header["ack_offset"] == 5  # the positions the consumer was handed took
        again = await new_master.request(RequestCode.PULL, {**header, "timeout_ms": 0})
        assert again.header["runs"] == []  # nothing comes again
    finally:
        await new_master.close()


async def _as_master(conn: Connection, ack: dict[str, Any]) -> Frame:
    """ACK to a broker the meta server promoted, once it learnt so itself (its next heartbeat)."""
    deadline = asyncio.get_running_loop().time() + 10
    while True:
        try:
            return await conn.request(RequestCode.ACK, ack)
        except BrokerError as exc:
            if exc.status != Status.NOT_MASTER or asyncio.get_running_loop().time() > deadline:
                raise
        await asyncio.sleep(0.1)  # its promotion comes with its next heartbeat answer, bounded above
