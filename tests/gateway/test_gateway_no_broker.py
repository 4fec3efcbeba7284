"""A gateway whose meta server knows no broker: answers 503 NO_BROKER with what to do, never a
server error page, and comes up regardless (brokers may register later)."""

from __future__ import annotations

from pathlib import Path

import aiohttp
import pytest
from gatewayhelpers import get, post

from qmq.testing import running_gateway, running_role

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
