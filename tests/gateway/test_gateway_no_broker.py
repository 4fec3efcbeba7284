"""A gateway whose meta server knows no broker: answers 503 NO_BROKER with what to do, never a
server error page, and comes up regardless (brokers may register later); once one has, its
receipts are settled before the gateway's next refresh would have learnt of it."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from gatewayhelpers import get, post, pull_until

from qmq.testing import running_gateway, running_role, write_config

pytestmark = [pytest.mark.integration]


async def test_no_broker_is_503(tmp_path: Path) -> None:
    meta_args = ["meta", "--data-dir", str(tmp_path / "meta"), "--host", "127.0.0.1", "--port", "0"]
    with running_role(meta_args) as meta, running_gateway(meta.meta_server) as gw:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
            status, doc = await post(http, f"{gw.gateway}/v1/subjects/s1/groups/g/pull", {"timeout_ms": 0})
            assert status == 503
            assert doc["error"]["code"] == "NO_BROKER"
            assert "is a broker running" in doc["error"]["message"]
            status, doc = await get(http, f"{gw.gateway}/v1/subjects")
            assert status == 503
            assert doc["error"]["code"] == "NO_BROKER"
            health = {"ok": True, "alive": True, "ready": True, "held": 0, "expired": 0, "holds_taken_again": 0}
            assert await get(http, f"{gw.gateway}/health") == (200, health)


async def test_receipts_of_a_broker_that_came_after_the_gateway_are_settled(tmp_path: Path) -> None:
    # The gateway's own refresh is 10 minutes away: only asking the meta server again when a
    # receipt names a group it has not heard of lets it hold and ack (`qmq standalone` starts the
    # gateway beside the broker, and a client acks as soon as it pulled).
    config = write_config(tmp_path / "qmq.toml", {"meta": {"client_refresh_ms": 600_000}})
    meta_args = ["meta", "--config", str(config), "--data-dir", str(tmp_path / "meta"), "--host", "127.0.0.1"]
    with running_role([*meta_args, "--port", "0"]) as meta, running_gateway(meta.meta_server) as gw:
        broker_args = ["broker", "--data-dir", str(tmp_path / "b"), "--meta-server", meta.meta_server]
        with running_role([*broker_args, "--host", "127.0.0.1", "--port", "0"]):
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
                # the listings ask again too when the gateway knows no broker group
                status, doc = await get(http, f"{gw.gateway}/v1/subjects")
                assert status == 200, doc
                sent = {"messages": [{"body": f"m{i}", "message_id": f"id-{i}"} for i in range(3)]}
                assert (await post(http, f"{gw.gateway}/v1/subjects/late/messages", sent))[0] == 200
                pull_url = f"{gw.gateway}/v1/subjects/late/groups/g/pull"
                got = await pull_until(http, pull_url, 3, 20, start_from="earliest")
                assert [m["message_id"] for m in got] == ["id-0", "id-1", "id-2"]
                status, doc = await post(http, f"{gw.gateway}/v1/acks", {"acks": [m["receipt"] for m in got]})
                assert (status, [r["status"] for r in doc["results"]]) == (200, ["acked"] * 3), doc
                _, health = await get(http, f"{gw.gateway}/health")
                assert health["held"] == 0
