"""`qmq cluster up --gateways N`: N HTTP gateways started after the brokers, each its own process
on a free port, listed in the ready line; a message sent to each is stored, and `down` stops them."""

from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
from clusterhelpers import cluster_up, fast_config

from qmq import Consumer
from qmq.cli.cluster_launch import is_running

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def _post(url: str, doc: object) -> tuple[int, object]:
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as resp:
        return int(resp.status), json.loads(resp.read())


def test_up_starts_gateways_that_send(tmp_path: Path) -> None:
    data_dir = tmp_path / "cluster"
    args = ["--broker-groups", "1", "--slaves", "0", "--delay-groups", "0", "--gateways", "2"]
    with cluster_up(data_dir, args, fast_config(tmp_path / "fast.toml")) as c:
        gateways = c.ready["gateways"].split(",")
        assert len(gateways) == 2
        assert len(set(gateways)) == 2
        members = c.file().members
        assert [m.name for m in members if m.role == "gateway"] == ["g1", "g2"]
        subject = f"test.{uuid.uuid4().hex[:12]}"
        for i, url in enumerate(gateways):
            assert _post(f"{url}/v1/subjects/{subject}/messages", {"body": f"via {i}", "message_id": f"m{i}"}) == (
                200,
                {"message_id": f"m{i}"},
            )
        with Consumer(app_code="test", meta_server=c.meta_server) as consumer:
            pc = consumer.pull_consumer(subject, "g", "earliest")
            got: list[str] = []
            for _ in range(50):
                batch = pc.pull(10, 200)
                got += [m.message_id for m in batch]
                batch.ack_all()
                if len(got) == 2:
                    break
        assert sorted(got) == ["m0", "m1"]
        # one receipt key for the cluster's gateways: pulled through g1, acked through g2
        _post(f"{gateways[0]}/v1/subjects/{subject}/messages", {"body": "lb", "message_id": "m-lb"})
        pull = {"max_messages": 1, "timeout_ms": 5_000, "start_from": "earliest"}
        _status, pulled = _post(f"{gateways[0]}/v1/subjects/{subject}/groups/http/pull", pull)
        receipts = [m["receipt"] for m in pulled["messages"]]  # type: ignore[index]  # pulled: a JSON object
        assert len(receipts) == 1
        assert _post(f"{gateways[1]}/v1/acks", {"acks": receipts}) == (
            200,
            {"results": [{"receipt": receipts[0], "status": "acked"}]},
        )
        assert (data_dir / "gateway-receipt.key").stat().st_mode & 0o777 == 0o600
    assert not any(is_running(m) for m in members)
