"""A client's refresh against a real MetaServer (127.0.0.1, port 0): every subject's route is
asked for again only when the meta server's routes_version says a route may have changed, or a
broker group became available; between them one request brings the groups."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from qmq.client import meta as client_meta
from qmq.client.meta import MetaClient
from qmq.common.clock import ManualClock
from qmq.common.config import MetaConfig
from qmq.common.errors import MetaServerError
from qmq.common.limits import META_SUBJECTS_PER_REQUEST_MAX
from qmq.meta import MetaServer

pytestmark = pytest.mark.integration

# More subjects than one request takes: a full refresh is two requests.
SUBJECTS = [f"s{i}" for i in range(META_SUBJECTS_PER_REQUEST_MAX + 10)]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[MetaServer]:
    # refresh_ms at its longest: the client's background refresh stays out of the counts
    config = MetaConfig(
        data_dir=tmp_path / "meta", host="127.0.0.1", port=0, heartbeat_timeout_ms=30_000, client_refresh_ms=600_000
    )
    s = MetaServer(config, ManualClock())
    await s.start()
    yield s
    await s.stop()


@contextlib.asynccontextmanager
async def _client(server: MetaServer) -> AsyncIterator[MetaClient]:
    meta = MetaClient(server.meta_server_url, timeout_ms=5000)
    await meta.start()
    try:
        yield meta
    finally:
        await meta.close()


async def _register(http: aiohttp.ClientSession, server: MetaServer, group: str, port: int) -> None:
    address, http_address = f"127.0.0.1:{port}", f"127.0.0.1:{port + 1000}"
    body = {"role": "broker", "group": group, "address": address, "http": http_address, "pid": 4242}
    async with http.post(f"{server.url}/meta/register", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _post(http: aiohttp.ClientSession, server: MetaServer, path: str, body: dict[str, Any]) -> None:
    async with http.post(f"{server.url}{path}", json=body) as resp:
        assert resp.status == 200, await resp.text()


async def _refresh(meta: MetaClient) -> tuple[int, int]:
    """Refresh once: (requests made, full refreshes made)."""
    requests, fulls = meta.refreshes, meta.full_refreshes
    await meta.refresh()
    return meta.refreshes - requests, meta.full_refreshes - fulls


async def _resolved(meta: MetaClient) -> None:
    for s in SUBJECTS:
        await meta.resolve(s)


async def test_routes_are_asked_for_again_only_when_the_meta_server_says_one_changed(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _register(http, server, "b1", 20881)
    async with _client(server) as meta:
        await _resolved(meta)
        assert {meta.route(s) for s in SUBJECTS} == {("b1",)}
        assert await _refresh(meta) == (2, 1)  # the first refresh is full
        for _ in range(3):  # nothing changed: the groups and no subject
            assert await _refresh(meta) == (1, 0)

        # A new subject's route leaves the version as it is: only it is asked for until routed.
        await meta.resolve("late")
        assert await _refresh(meta) == (1, 0)

        # A second group becomes available: the routes widen to it, seen at the next refresh.
        await _register(http, server, "b2", 20891)
        assert (await _refresh(meta))[1] == 1
        assert {meta.route(s) for s in [*SUBJECTS, "late"]} == {("b1", "b2")}
        # the widening changed the version between the full refresh's requests: one more is full
        while (await _refresh(meta))[1]:
            pass
        assert await _refresh(meta) == (1, 0)

        # Draining b1 changes what the routes send to: every send route is asked for again.
        await _post(http, server, "/meta/drain", {"group": "b1", "by": "ops@test"})
        assert (await _refresh(meta))[1] == 1
        assert {meta.send_route(s) for s in SUBJECTS} == {("b2",)}
        assert meta.route(SUBJECTS[0]) == ("b1", "b2")  # consumers still pull both


async def test_a_full_refresh_comes_every_so_many_refreshes_whatever_the_version_says(
    http: aiohttp.ClientSession, server: MetaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(client_meta, "_FULL_REFRESH_EVERY", 3)
    await _register(http, server, "b1", 20881)
    async with _client(server) as meta:
        await _resolved(meta)
        counts = [await _refresh(meta) for _ in range(9)]
        assert counts == [(2, 1), (1, 0), (1, 0), (1, 0), (2, 1), (1, 0), (1, 0), (1, 0), (2, 1)]


async def test_a_meta_server_without_a_routes_version_gets_full_refreshes(
    http: aiohttp.ClientSession, server: MetaServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = client_meta.parse_answer

    def unversioned(url: str, doc: object) -> client_meta.MetaAnswer:
        assert isinstance(doc, dict)
        doc.pop("routes_version")  # as an older meta server answers
        return real(url, doc)

    monkeypatch.setattr(client_meta, "parse_answer", unversioned)
    await _register(http, server, "b1", 20881)
    async with _client(server) as meta:
        await _resolved(meta)
        assert [await _refresh(meta) for _ in range(3)] == [(2, 1)] * 3


async def test_a_routes_version_that_is_not_a_string_is_refused_naming_it() -> None:
    doc = {"broker_groups": [], "routes": {}, "routes_version": 7}
    with pytest.raises(client_meta.MetaServerError, match="'routes_version' = 7"):
        client_meta.parse_answer("http://meta", doc)


async def test_fresh_brings_a_group_that_came_after_the_last_refresh_in_one_shared_request(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    async with _client(server) as meta:
        assert meta.groups == {}
        await _register(http, server, "b1", 20881)
        requests = meta.refreshes
        # callers at once share one refresh (the background one is ten minutes away)
        await asyncio.gather(*(meta.fresh() for _ in range(20)))
        assert meta.refreshes - requests == 1
        assert set(meta.groups) == {"b1"}
    with pytest.raises(MetaServerError, match="not started"):
        await meta.fresh()


async def test_fresh_returns_when_the_refresh_fails_and_keeps_the_last_answer(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _register(http, server, "b1", 20881)
    async with _client(server) as meta:
        assert set(meta.groups) == {"b1"}
        await server.stop()
        # the meta server is gone: the refresh fails, fresh() returns at once with what was known
        await asyncio.wait_for(meta.fresh(timeout_ms=60_000), 10)
        assert set(meta.groups) == {"b1"}
