"""An ack is answered as done only once the slave has it: a master that cannot replicate says
so, and the SDK sends the ack again, so an answered ack always survives a failover."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config

from qmq.aio import Consumer, Producer
from qmq.client.connection import Connection
from qmq.common.errors import BrokerError
from qmq.protocol.codes import RequestCode, Status

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]


def test_acks_the_slave_cannot_get_are_not_answered_as_done(tmp_path: Path) -> None:
    config = fast_config(tmp_path / "fast.toml")
    args = ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, config) as c:
        c.wait_view("the slave replicating", lambda v: any(s["replicated_ms"] for s in v["servers"]))
        master = c.view()["groups"][0]["master"]
        asyncio.run(_while_read_only(c, master))


async def _while_read_only(c: object, master: str) -> None:
    meta_server = c.meta_server  # type: ignore[attr-defined]
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await asyncio.gather(*(producer.send(producer.generate_message("ack.truth")) for _ in range(2)))
    async with Consumer(app_code="billing", meta_server=meta_server, consumer_id="c1") as consumer:
        pull = consumer.pull_consumer("ack.truth", "g", "earliest")
        got = await pull.pull(max_messages=2, timeout_ms=10_000)
        assert len(got) == 2
        os.kill(c.member("b1-s1").pid, signal.SIGKILL)  # type: ignore[attr-defined]
        await asyncio.to_thread(
            c.wait_view,  # type: ignore[attr-defined]
            "the group read-only",
            lambda v: v["groups"][0]["write_state"] == "read-only",
        )
        conn = Connection(master, connect_timeout_ms=5000)
        try:
            header = {"subject": "ack.truth", "group": "g", "consumer_id": "c1", "ranges": [[0, 1]]}
            with pytest.raises(BrokerError, match="not yet on its slave") as refused:
                await conn.request(RequestCode.ACK, header)
            assert refused.value.status == Status.BUSY
            many = {"consumer_id": "c1", "acks": [{"subject": "ack.truth", "group": "g", "ranges": [[0, 1]]}]}
            with pytest.raises(BrokerError, match="not yet on its slave"):
                await conn.request(RequestCode.ACK_MANY, many)
            request = {"subject": "ack.truth", "group": "g", "consumer_id": "c1", "session": "raw", "max": 1}
            pulled = await conn.request(RequestCode.PULL, {**request, "timeout_ms": 0, "ack": [[1, 2]]})
            assert "not yet on its slave" not in str(pulled.header)  # the pull is answered...
            assert "read-only" in pulled.header["acks_error"]  # ...saying its acks are not done
        finally:
            await conn.close()
        # the SDK keeps the acks it could not get answered as done
        got[0].ack()
        with pytest.raises(BrokerError, match="not yet on its slave"):
            await consumer.flush_acks()  # says the acks are not done...
        tracker = next(iter(pull._main.trackers.values()))  # type: ignore[attr-defined]
        assert tracker.pending  # ...and keeps them for a later request
