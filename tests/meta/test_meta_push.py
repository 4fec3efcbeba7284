"""Push subscriptions and their leases on a real MetaServer (127.0.0.1 port 0, SQLite): the HTTP
API, refusals that name the field, leases taken by exactly one gateway, and a restart."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from qmq.common.clock import ManualClock
from qmq.common.config import MetaConfig
from qmq.meta import MetaServer

pytestmark = pytest.mark.integration


def _config(data_dir: Path) -> MetaConfig:
    return MetaConfig(data_dir=data_dir, host="127.0.0.1", port=0, heartbeat_timeout_ms=30_000)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def server(tmp_path: Path, clock: ManualClock) -> AsyncIterator[MetaServer]:
    s = MetaServer(_config(tmp_path / "meta"), clock, autotick=False)
    await s.start()
    yield s
    await s.stop()


def _sub(**changes: Any) -> dict[str, Any]:
    return {"subject": "orders", "group": "billing", "url": "http://127.0.0.1:9/hook", "secret": "s3cret", **changes}


async def _post(http: aiohttp.ClientSession, url: str, body: object) -> tuple[int, Any]:
    async with http.post(url, json=body) as r:
        return r.status, await r.json()


async def _lease(http: aiohttp.ClientSession, server: MetaServer, owner: str, **extra: Any) -> list[dict[str, Any]]:
    status, body = await _post(http, server.url + "/meta/push/lease", {"owner": owner, "lease_ms": 5_000, **extra})
    assert status == 200, body
    assert body["lease_ms"] == 5_000
    return list(body["subscriptions"])


async def test_add_list_remove(server: MetaServer, http: aiohttp.ClientSession, clock: ManualClock) -> None:
    status, body = await _post(http, server.url + "/meta/push", _sub(tags=["b", "a"], concurrency=3))
    assert status == 201, body
    assert body["subscription"]["secret"] == "***"
    assert body["subscription"]["created_at_ms"] == clock.now_ms()
    async with http.get(server.url + "/meta/push") as r:
        listed = (await r.json())["subscriptions"]
    assert [(s["subject"], s["group"], s["tags"], s["concurrency"], s["secret"]) for s in listed] == [
        ("orders", "billing", ["a", "b"], 3, "***")
    ]
    assert listed[0]["leased"] is False
    assert listed[0]["owner"] is None

    status, body = await _post(http, server.url + "/meta/push", _sub(url="http://elsewhere/"))
    assert status == 409
    assert "exists already" in body["error"]
    assert "qmq push remove" in body["error"]

    async with http.delete(server.url + "/meta/push", params={"subject": "orders", "group": "billing"}) as r:
        assert r.status == 200
    async with http.delete(server.url + "/meta/push", params={"subject": "orders", "group": "billing"}) as r:
        assert r.status == 404
        assert "no push subscription" in (await r.json())["error"]
    async with http.get(server.url + "/meta/push") as r:
        assert (await r.json())["subscriptions"] == []


@pytest.mark.parametrize(
    ("changes", "field", "words"),
    [
        ({"url": "ftp://host/x"}, "url", "http:// or https://"),
        ({"url": "http://"}, "url", "with a host"),
        ({"concurrency": 0}, "concurrency", "from 1 to 1000"),
        ({"rate_per_s": -1}, "rate_per_s", "0 for no bound"),
        ({"timeout_ms": 5}, "timeout_ms", "from 100"),
        ({"tags": ["x"] * 11}, "tags", "at most 10"),
        ({"start_from": "middle"}, "start_from", "'latest', 'earliest'"),
        ({"group": "a b"}, "group", "whitespace"),
        ({"concurency": 3}, "concurency", "unknown field"),
        ({"retry_backoff_ms": [1.5]}, "retry_backoff_ms", "whole number of ms"),
    ],
)
async def test_bad_subscription_is_refused_naming_the_field(
    server: MetaServer, http: aiohttp.ClientSession, changes: dict[str, Any], field: str, words: str
) -> None:
    status, body = await _post(http, server.url + "/meta/push", _sub(**changes))
    assert status == 400
    assert body["field"] == field
    assert words in body["error"]


async def test_one_gateway_holds_each_lease_and_the_gateways_share_them(
    server: MetaServer, http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    assert (await _post(http, server.url + "/meta/push", _sub()))[0] == 201
    assert (await _post(http, server.url + "/meta/push", _sub(group="audit")))[0] == 201

    def groups(held: list[dict[str, Any]]) -> list[tuple[str, int]]:
        return [(s["subscription"]["group"], s["generation"]) for s in held]

    a = await _lease(http, server, "gw-a")
    assert groups(a) == [("audit", 1), ("billing", 1)]  # the only gateway: both
    assert a[0]["subscription"]["secret"] == "s3cret"  # the holder needs it to sign
    assert await _lease(http, server, "gw-b") == []  # both held by A

    clock.advance(4)
    assert groups(await _lease(http, server, "gw-a")) == [("audit", 1)]  # its share among two: one
    assert groups(await _lease(http, server, "gw-b")) == [("billing", 2)]
    clock.advance(4)
    assert groups(await _lease(http, server, "gw-b")) == [("billing", 2)]  # A's audit runs until 9 000

    clock.advance(2)  # A stopped asking: its lease ran out at 9 000
    assert groups(await _lease(http, server, "gw-b")) == [("audit", 2), ("billing", 2)]
    assert await _lease(http, server, "gw-a") == []  # A learns it lost it

    async with http.get(server.url + "/meta/push") as r:
        listed = (await r.json())["subscriptions"]
    assert {s["owner"] for s in listed} == {"gw-b"}
    assert all(s["leased"] for s in listed)

    status, body = await _post(http, server.url + "/meta/push/release", {"owner": "gw-b"})
    assert (status, body) == (200, {"released": 2})
    assert len(await _lease(http, server, "gw-a")) == 2  # free at once, no waiting for the expiry


async def test_held_max_bounds_what_one_gateway_takes(server: MetaServer, http: aiohttp.ClientSession) -> None:
    for group in ("g1", "g2", "g3"):
        assert (await _post(http, server.url + "/meta/push", _sub(group=group)))[0] == 201
    assert len(await _lease(http, server, "gw-a", held_max=2)) == 2
    assert len(await _lease(http, server, "gw-b", held_max=2)) == 1


async def test_lease_request_is_checked(server: MetaServer, http: aiohttp.ClientSession) -> None:
    status, body = await _post(http, server.url + "/meta/push/lease", {"owner": "", "lease_ms": 5_000})
    assert status == 400
    assert body["field"] == "owner"
    status, body = await _post(http, server.url + "/meta/push/lease", {"owner": "a", "lease_ms": 10})
    assert status == 400
    assert body["field"] == "lease_ms"


async def test_subscriptions_and_leases_survive_a_restart(
    tmp_path: Path, http: aiohttp.ClientSession, clock: ManualClock
) -> None:
    first = MetaServer(_config(tmp_path / "meta"), clock, autotick=False)
    await first.start()
    try:
        assert (await _post(http, first.url + "/meta/push", _sub(retry_backoff_ms=[100, 200])))[0] == 201
        held = await _lease(http, first, "gw-a")
    finally:
        await first.stop()
    second = MetaServer(_config(tmp_path / "meta"), clock, autotick=False)
    await second.start()
    try:
        again = await _lease(http, second, "gw-a")
        assert again == held  # the same subscription, the same holder, no change of hands
        assert again[0]["subscription"]["retry_backoff_ms"] == [100, 200]
        assert await _lease(http, second, "gw-b") == []
    finally:
        await second.stop()
