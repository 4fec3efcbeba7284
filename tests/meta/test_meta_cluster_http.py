"""The cluster side of the meta server's HTTP API on 127.0.0.1 port 0: the heartbeat answer and
the keys servers report, GET /meta/cluster, POST /meta/promote, and automatic promotion by the
leader's tick (on by default, off with auto_promote)."""

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

TIMEOUT_MS = 30_000
# Long enough that the background tick never runs during a test: each test ticks by hand.
LEASE_MS = 600_000


def _config(data_dir: Path, **changes: Any) -> MetaConfig:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "heartbeat_timeout_ms": TIMEOUT_MS,
        "leader_lease_ms": LEASE_MS,
        **changes,
    }
    return MetaConfig(data_dir=data_dir, **values)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
async def server(tmp_path: Path, clock: ManualClock) -> AsyncIterator[MetaServer]:
    s = MetaServer(_config(tmp_path / "meta"), clock)
    await s.start()
    yield s
    await s.stop()


def _body(port: int, role_in_group: str = "master", group: str = "b1", **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "role": "broker",
        "group": group,
        "address": f"127.0.0.1:{port}",
        "http": f"127.0.0.1:{port + 1000}",
        "pid": port,
        "role_in_group": role_in_group,
        "epoch": 0,
    }
    body.update(changes)
    return body


async def _register(http: aiohttp.ClientSession, server: MetaServer, port: int, *args: Any, **kw: Any) -> Any:
    async with http.post(f"{server.url}/meta/register", json=_body(port, *args, **kw)) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _cluster(http: aiohttp.ClientSession, server: MetaServer, **params: str) -> Any:
    async with http.get(f"{server.url}/meta/cluster", params=params) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _promote(http: aiohttp.ClientSession, server: MetaServer, body: object) -> tuple[int, Any]:
    async with http.post(f"{server.url}/meta/promote", json=body) as resp:
        return resp.status, await resp.json()


async def _pair(http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock) -> None:
    await _register(http, server, 20881, epoch=1, log_end=900, action_end=80, write_state="ok")
    await _register(http, server, 20882, "slave", epoch=1, log_end=700, action_end=60, replicated_ms=clock.now_ms())


async def test_the_heartbeat_answer_says_role_epoch_master_and_slaves(
    http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock
) -> None:
    waiting = await _register(http, server, 20882, "slave")
    assert waiting == {
        "ok": True,
        "heartbeat_ms": TIMEOUT_MS // 3,
        "role_in_group": "slave",
        "epoch": 0,
        "master": None,
        "slaves": 0,
        "slave_addresses": [],
        "truncate": None,
    }
    master = await _register(http, server, 20881)
    assert (master["role_in_group"], master["epoch"], master["master"], master["slaves"]) == ("master", 1, None, 1)
    assert master["slave_addresses"] == ["127.0.0.1:20882"]  # whose REPLICATE requests the master counts
    slave = await _register(http, server, 20882, "slave")
    assert (slave["role_in_group"], slave["master"]) == ("slave", "127.0.0.1:20881")


async def test_cluster_lists_groups_servers_lag_write_state_routes_and_the_leader(
    http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock
) -> None:
    await _pair(http, server, clock)
    await _register(http, server, 20891, group="b2", epoch=1, log_end=10, write_state="read-only")
    await _register(http, server, 30881, role="delay", group="d1", epoch=None)
    async with http.get(server.meta_server_url, params=[("subject", "s1"), ("subject", "s2")]) as resp:
        assert resp.status == 200
    view = await _cluster(http, server)

    assert view["time_ms"] == clock.now_ms()
    meta = view["meta"]
    assert (meta["url"], meta["owner"], meta["leading"]) == (server.url, server.owner, True)
    assert meta["leader"] == {"owner": server.owner, "url": server.url, "expires_ms": clock.now_ms() + LEASE_MS}
    assert (meta["heartbeat_timeout_ms"], meta["auto_promote"], meta["route_groups"]) == (TIMEOUT_MS, True, 2)

    groups = {(g["role"], g["group"]): g for g in view["groups"]}
    assert set(groups) == {("broker", "b1"), ("broker", "b2"), ("delay", "d1")}
    b1 = groups[("broker", "b1")]
    assert {k: b1[k] for k in ("epoch", "master", "state", "write_state", "slaves", "message_offset")} == {
        "epoch": 1,
        "master": "127.0.0.1:20881",
        "state": "available",
        "write_state": "ok",
        "slaves": 1,
        "message_offset": None,
    }
    assert groups[("broker", "b2")]["write_state"] == "read-only"

    servers = {s["address"]: s for s in view["servers"]}
    slave = servers["127.0.0.1:20882"]
    assert {k: slave[k] for k in ("role", "group", "role_in_group", "epoch", "pid", "state", "log_end", "lag")} == {
        "role": "broker",
        "group": "b1",
        "role_in_group": "slave",
        "epoch": 1,
        "pid": 20882,
        "state": "available",
        "log_end": 700,
        "lag": 200,
    }
    assert slave["http"] == "127.0.0.1:21882"
    assert slave["last_heartbeat_ms"] == clock.now_ms()
    assert servers["127.0.0.1:20881"]["lag"] == 0
    assert servers["127.0.0.1:30881"]["epoch"] is None
    assert [s["role"] for s in view["servers"]] == ["broker"] * 3 + ["delay"]

    assert view["routes"] == {"s1": ["b1", "b2"], "s2": ["b1", "b2"]}
    assert view["subjects_total"] == 2
    limited = await _cluster(http, server, routes_max="1")
    assert (limited["routes"], limited["subjects_total"]) == ({"s1": ["b1", "b2"]}, 2)


async def test_routes_max_is_checked(http: aiohttp.ClientSession, server: MetaServer) -> None:
    async with http.get(f"{server.url}/meta/cluster", params={"routes_max": "lots"}) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["field"] == "routes_max"
    assert "routes_max 'lots' must be a whole number from 0 to 10000" in error["error"]


async def test_promote_by_hand_makes_the_slave_master_at_once(
    http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock
) -> None:
    await _pair(http, server, clock)
    status, body = await _promote(http, server, {"group": "b1", "role": "broker"})
    assert status == 200, body
    assert body == {
        "ok": True,
        "role": "broker",
        "group": "b1",
        "epoch": 2,
        "master": "127.0.0.1:20882",
        "previous_master": "127.0.0.1:20881",
        "message_offset": 700,
        "action_offset": 60,
    }
    async with http.get(server.meta_server_url) as resp:
        [group] = (await resp.json())["broker_groups"]
    assert group["address"] == "127.0.0.1:20882"
    # The old master, still alive, is told on its next heartbeat.
    answer = await _register(http, server, 20881, epoch=1, log_end=950)
    assert (answer["role_in_group"], answer["master"], answer["epoch"]) == ("slave", "127.0.0.1:20882", 2)
    assert answer["truncate"] == {"message_offset": 700, "action_offset": 60}


@pytest.mark.parametrize(
    ("body", "status", "field", "text"),
    [
        ({"group": "b1"}, 409, "group", "broker group 'b1' has no fresh slave to promote"),
        ({"group": "b9"}, 404, "group", "no broker group 'b9' has registered"),
        ({"group": "b1", "role": "realtime"}, 400, "role", "role 'realtime' is not allowed"),
        ({"role": "broker"}, 400, "group", "group is missing"),
        ({"group": "a b"}, 400, "group", "group 'a b' contains ' '"),
        (["b1"], 400, "body", "must be a JSON object"),
    ],
)
async def test_a_promotion_that_cannot_be_done_is_refused_naming_why(
    http: aiohttp.ClientSession,
    server: MetaServer,
    body: object,
    status: int,
    field: str,
    text: str,
) -> None:
    await _register(http, server, 20881, epoch=1)
    await _register(http, server, 20882, "slave", epoch=1)  # never replicated
    got, error = await _promote(http, server, body)
    assert got == status
    assert error["field"] == field
    assert text in error["error"]


async def test_the_leader_tick_promotes_when_the_master_is_silent_past_the_timeout(
    http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock
) -> None:
    await _pair(http, server, clock)
    died_ms = clock.now_ms()
    clock.advance(TIMEOUT_MS / 1000 / 2)
    await _register(http, server, 20882, "slave", epoch=1, log_end=720, replicated_ms=died_ms)
    assert await server.tick() == []
    clock.advance(TIMEOUT_MS / 1000 / 2 + 0.001)
    [promotion] = await server.tick()
    assert (promotion.group.master, promotion.group.epoch, promotion.group.message_offset) == (
        "127.0.0.1:20882",
        2,
        720,
    )
    async with http.get(f"{server.url}/metrics") as resp:
        assert 'qmq_meta_promotions_total{how="auto",role="broker"} 1.0' in await resp.text()


async def test_without_auto_promote_only_a_promotion_by_hand_happens(
    http: aiohttp.ClientSession, tmp_path: Path, clock: ManualClock
) -> None:
    server = MetaServer(_config(tmp_path / "meta", auto_promote=False), clock)
    await server.start()
    try:
        await _pair(http, server, clock)
        clock.advance(TIMEOUT_MS / 1000 / 2)
        await _register(http, server, 20882, "slave", epoch=1, replicated_ms=clock.now_ms())
        clock.advance(TIMEOUT_MS / 1000 / 2 + 1)
        assert await server.tick() == []
        assert (await _cluster(http, server))["meta"]["auto_promote"] is False
        status, body = await _promote(http, server, {"group": "b1"})
        assert (status, body["master"]) == (200, "127.0.0.1:20882")
    finally:
        await server.stop()


@pytest.mark.parametrize(
    ("changes", "field", "text"),
    [
        ({"epoch": -1}, "epoch", "epoch must be a whole number from 0"),
        ({"epoch": "1"}, "epoch", "got '1'"),
        ({"log_end": 1.5}, "log_end", "log_end must be a whole number from 0"),
        ({"action_end": True}, "action_end", "got True"),
        ({"replicated_ms": -5}, "replicated_ms", "got -5"),
        ({"write_state": "broken"}, "write_state", "write_state 'broken' is not allowed; use one of 'ok'"),
    ],
)
async def test_bad_replication_keys_in_a_heartbeat_are_refused_naming_them(
    http: aiohttp.ClientSession, server: MetaServer, changes: dict[str, Any], field: str, text: str
) -> None:
    async with http.post(f"{server.url}/meta/register", json=_body(20881, **changes)) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["field"] == field
    assert text in error["error"]


async def test_a_report_without_the_replication_keys_still_registers(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    body = _body(20881)
    for key in ("role_in_group", "epoch"):
        del body[key]
    async with http.post(f"{server.url}/meta/register", json={**body, "replicated_ms": None}) as resp:
        assert resp.status == 200
        assert (await resp.json())["role_in_group"] == "master"
