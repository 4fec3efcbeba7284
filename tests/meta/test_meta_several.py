"""Several meta servers on one PostgreSQL or MariaDB database: exactly one leads, only the leader
promotes, another takes over when the leader stops renewing its lease, every meta server
takes heartbeats and serves what the others wrote, and nothing is lost when one stops."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from meta_databases import Database, fresh_database

from qmq.common.clock import ManualClock
from qmq.common.config import MetaConfig
from qmq.meta import MetaServer
from qmq.meta.registry import READ_CACHE_MS
from qmq.testing import running_role

pytestmark = pytest.mark.integration

TIMEOUT_MS = 30_000
LEASE_MS = 60_000


@pytest.fixture(params=["postgresql", "mariadb"])
def db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Database]:
    with fresh_database(request.param, tmp_path) as database:
        yield database


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _config(tmp_path: Path, db: Database, name: str, **changes: Any) -> MetaConfig:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "heartbeat_timeout_ms": TIMEOUT_MS,
        "leader_lease_ms": LEASE_MS,
        "db_url": db.url,
        **changes,
    }
    return MetaConfig(data_dir=tmp_path / name, **values)


@pytest.fixture
async def pair(tmp_path: Path, db: Database, clock: ManualClock) -> AsyncIterator[tuple[MetaServer, MetaServer]]:
    """Meta servers a (started first: it leads) and b on one database, ticked by hand."""
    a = MetaServer(_config(tmp_path, db, "a"), clock, autotick=False)
    b = MetaServer(_config(tmp_path, db, "b"), clock, autotick=False)
    await a.start()
    try:
        await b.start()
        try:
            yield a, b
        finally:
            await b.stop()
    finally:
        await a.stop()


async def _register(http: aiohttp.ClientSession, meta: MetaServer, port: int, role_in_group: str, **kw: Any) -> Any:
    body = {
        "role": "broker",
        "group": "b1",
        "address": f"127.0.0.1:{port}",
        "http": f"127.0.0.1:{port + 1000}",
        "pid": port,
        "role_in_group": role_in_group,
        "epoch": 1,
        **kw,
    }
    async with http.post(f"{meta.url}/meta/register", json=body) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as resp:
        assert resp.status == 200, await resp.text()
        return await resp.json()


def _after_cache(clock: ManualClock) -> None:
    clock.advance(READ_CACHE_MS / 1000)


async def test_one_leads_and_each_serves_what_the_other_took(
    http: aiohttp.ClientSession, pair: tuple[MetaServer, MetaServer], clock: ManualClock
) -> None:
    a, b = pair
    for meta in (a, b):
        view = await _get(http, f"{meta.url}/meta/cluster")
        assert view["meta"]["leader"]["url"] == a.url
        assert view["meta"]["leading"] is (meta is a)

    await _register(http, a, 20881, "master")
    await _register(http, b, 20882, "slave", replicated_ms=clock.now_ms())
    _after_cache(clock)
    for meta in (a, b):
        [group] = (await _get(http, meta.meta_server_url))["broker_groups"]
        assert (group["group"], group["address"], group["state"]) == ("b1", "127.0.0.1:20881", "available")
        servers = (await _get(http, f"{meta.url}/meta/cluster"))["servers"]
        assert [(s["address"], s["role_in_group"]) for s in servers] == [
            ("127.0.0.1:20881", "master"),
            ("127.0.0.1:20882", "slave"),
        ]
    # A route made at one is the route at the other.
    routed = (await _get(http, f"{a.meta_server_url}?subject=s1"))["routes"]
    assert routed == {"s1": ["b1"]}
    assert (await _get(http, f"{b.meta_server_url}?subject=s1"))["routes"] == routed


async def test_only_the_leader_promotes_and_another_takes_over_once_it_stops_renewing(
    http: aiohttp.ClientSession, pair: tuple[MetaServer, MetaServer], clock: ManualClock
) -> None:
    a, b = pair
    await _register(http, a, 20881, "master", log_end=100)
    died_ms = clock.now_ms()
    clock.advance(TIMEOUT_MS / 1000)
    await _register(http, b, 20882, "slave", log_end=100, replicated_ms=died_ms)
    clock.advance(0.001)
    assert await b.tick() == []  # b does not lead: it decides nothing
    async with http.post(f"{b.url}/meta/promote", json={"group": "b1"}) as resp:
        assert resp.status == 421
        refused = await resp.json()
    assert refused["leader"] == a.url
    assert f"send the promotion to the leader, {a.url}" in refused["error"]

    # a freezes (no more ticks); once its lease ran out, b leads and promotes.
    clock.advance(LEASE_MS / 1000)
    await _register(http, b, 20882, "slave", log_end=100, replicated_ms=died_ms)
    [promotion] = await b.tick()
    assert (promotion.group.epoch, promotion.group.master, promotion.group.changed_by) == (
        2,
        "127.0.0.1:20882",
        b.owner,
    )
    assert await a.tick() == []  # a wakes up: the lease is b's now
    view = await _get(http, f"{a.url}/meta/cluster")
    assert (view["meta"]["leader"]["url"], view["meta"]["leading"]) == (b.url, False)
    # The promoted slave learns it at either meta server.
    answer = await _register(http, a, 20882, "slave", log_end=100)
    assert (answer["role_in_group"], answer["epoch"]) == ("master", 2)


async def test_a_meta_server_stopping_loses_no_route_epoch_or_server(
    http: aiohttp.ClientSession, tmp_path: Path, db: Database, clock: ManualClock
) -> None:
    a = MetaServer(_config(tmp_path, db, "a"), clock, autotick=False)
    b = MetaServer(_config(tmp_path, db, "b"), clock, autotick=False)
    await a.start()
    await b.start()
    try:
        await _register(http, a, 20881, "master", log_end=100)
        await _register(http, a, 20882, "slave", log_end=100, replicated_ms=clock.now_ms())
        await _register(http, a, 20891, "master", group="b2")
        routes = (await _get(http, f"{a.meta_server_url}?subject=s1&subject=s2"))["routes"]
        async with http.post(f"{a.url}/meta/promote", json={"group": "b1"}) as resp:
            assert resp.status == 200
        await a.stop()  # gives up its lease
        assert await b.tick() == []
        _after_cache(clock)
        view = await _get(http, f"{b.url}/meta/cluster")
        assert view["meta"]["leader"]["url"] == b.url
        assert view["routes"] == routes == {"s1": ["b1", "b2"], "s2": ["b1", "b2"]}
        assert {(g["group"], g["epoch"], g["master"]) for g in view["groups"]} == {
            ("b1", 2, "127.0.0.1:20882"),
            ("b2", 1, "127.0.0.1:20891"),
        }
        assert len(view["servers"]) == 3
    finally:
        await a.stop()
        await b.stop()


async def test_with_real_time_the_other_leads_soon_after_the_leader_is_killed(
    http: aiohttp.ClientSession, tmp_path: Path, db: Database
) -> None:
    args = ["meta", "--data-dir", str(tmp_path / "a"), "--port", "0", "--db-url", db.url]
    # a lease of a second: a leader kept from renewing a 300 ms one by a loaded machine lost it
    # before b first looked (CI at load average 10-14)
    with running_role([*args, "--leader-lease-ms", "1000"]) as a:
        b = MetaServer(_config(tmp_path, db, "b", leader_lease_ms=1000))
        await b.start()
        try:
            a_url = a.meta_server.removesuffix("/meta/address")
            leader = (await _get(http, f"{b.url}/meta/cluster"))["meta"]["leader"]
            assert leader is not None, "b sees no leader: a's lease ran out before b looked"
            assert leader["url"] == a_url
            a.proc.send_signal(signal.SIGKILL)  # no chance to give the lease up: it must run out
            a.proc.wait()
            deadline = asyncio.get_running_loop().time() + 10
            while not (await _get(http, f"{b.url}/meta/cluster"))["meta"]["leading"]:
                assert asyncio.get_running_loop().time() < deadline, "b did not take the lease within 10 s"
                await asyncio.sleep(0.05)  # polling the survivor's own view: there is no event to wait on
        finally:
            await b.stop()
