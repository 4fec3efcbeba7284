"""The meta server's HTTP API against a real MetaServer on 127.0.0.1 port 0."""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from meta_databases import fresh_database
from prometheus_client.parser import text_string_to_metric_families

from qmq.common.clock import ManualClock
from qmq.common.config import MetaConfig
from qmq.common.limits import META_SUBJECTS_PER_REQUEST_MAX as SUBJECTS_PER_REQUEST_MAX
from qmq.meta import MetaServer, MetaStartupError

pytestmark = pytest.mark.integration

TIMEOUT_MS = 30_000


def _config(data_dir: Path, **changes: Any) -> MetaConfig:
    values: dict[str, Any] = {"host": "127.0.0.1", "port": 0, "heartbeat_timeout_ms": TIMEOUT_MS, **changes}
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


def _body(group: str = "broker-1", port: int = 20881, **changes: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "role": "broker",
        "group": group,
        "address": f"127.0.0.1:{port}",
        "http": f"127.0.0.1:{port + 1000}",
        "pid": 4242,
    }
    body.update(changes)
    return body


async def _register(http: aiohttp.ClientSession, server: MetaServer, **body: Any) -> dict[str, Any]:
    async with http.post(f"{server.url}/meta/register", json=_body(**body)) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


async def _address(http: aiohttp.ClientSession, server: MetaServer, *subjects: str) -> dict[str, Any]:
    async with http.get(server.meta_server_url, params=[("subject", s) for s in subjects]) as resp:
        assert resp.status == 200, await resp.text()
        result: dict[str, Any] = await resp.json()
        return result


async def test_urls_are_set_once_started(server: MetaServer) -> None:
    assert server.port > 0
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.meta_server_url == f"http://127.0.0.1:{server.port}/meta/address"


async def test_health(http: aiohttp.ClientSession, server: MetaServer) -> None:
    async with http.get(f"{server.url}/health") as resp:
        assert resp.status == 200
        assert await resp.json() == {"ok": True, "alive": True, "ready": True}


async def test_registered_groups_are_discovered_with_their_state_and_routes(
    http: aiohttp.ClientSession, server: MetaServer, clock: ManualClock
) -> None:
    assert await _register(http, server, group="b1", port=20881) == {
        "ok": True,
        "heartbeat_ms": TIMEOUT_MS // 3,
        "role_in_group": "master",
        "epoch": 1,
        "master": None,
        "slaves": 0,
        "slave_addresses": [],
        "truncate": None,
    }
    await _register(http, server, group="b2", port=20891)
    await _register(http, server, group="b2", port=20892, role_in_group="slave")
    await _register(http, server, group="d1", port=30881, role="delay")

    view = await _address(http, server)
    assert isinstance(view.pop("routes_version"), str)
    assert view == {
        "broker_groups": [
            {
                "group": "b1",
                "address": "127.0.0.1:20881",
                "http": "127.0.0.1:21881",
                "state": "available",
                "role": "master",
                "writable": True,
            },
            {
                "group": "b2",
                "address": "127.0.0.1:20891",
                "http": "127.0.0.1:21891",
                "state": "available",
                "role": "master",
                "writable": True,
            },
        ],
        "delay_groups": [
            {
                "group": "d1",
                "address": "127.0.0.1:30881",
                "http": "127.0.0.1:31881",
                "state": "available",
                "role": "master",
            },
        ],
        "routes": {},
        "send_routes": {},
        "refresh_ms": MetaConfig().client_refresh_ms,
    }

    view = await _address(http, server, "order.created", "order.paid", "order.created")
    assert view["routes"] == {"order.created": ["b1", "b2"], "order.paid": ["b1", "b2"]}

    clock.advance(TIMEOUT_MS / 1000 + 1)
    await _register(http, server, group="b2", port=20891)
    view = await _address(http, server, "order.paid")
    assert [(g["group"], g["state"]) for g in view["broker_groups"]] == [
        ("b1", "unavailable"),
        ("b2", "available"),
    ]
    assert view["delay_groups"][0]["state"] == "unavailable"
    assert view["routes"] == {"order.paid": ["b1", "b2"]}  # only what was asked; a route is never removed


@pytest.mark.parametrize("kind", ["sqlite", "postgresql", "mariadb"])
async def test_routes_survive_a_restart_of_the_meta_server(
    http: aiohttp.ClientSession, tmp_path: Path, clock: ManualClock, kind: str
) -> None:
    with fresh_database(kind, tmp_path) as db:
        config = _config(tmp_path / "meta", route_groups=2, db_url=db.url)
        first = MetaServer(config, clock)
        await first.start()
        try:
            for i, group in enumerate(("b1", "b2", "b3")):
                await _register(http, first, group=group, port=20881 + 10 * i)
            before = (await _address(http, first, "s1", "s2", "s3"))["routes"]
        finally:
            await first.stop()
        assert before == {"s1": ["b1", "b2"], "s2": ["b1", "b3"], "s3": ["b2", "b3"]}

        second = MetaServer(config, clock)
        await second.start()
        try:
            # Only b3 reports after the restart; the routes stay as they were.
            clock.advance(TIMEOUT_MS / 1000 + 1)
            await _register(http, second, group="b3", port=20901)
            after = await _address(http, second, "s1", "s2", "s3")
            assert after["routes"] == before
            assert [(g["group"], g["state"]) for g in after["broker_groups"]] == [
                ("b1", "unavailable"),
                ("b2", "unavailable"),
                ("b3", "available"),
            ]
        finally:
            await second.stop()


async def test_a_lost_store_is_answered_with_503_naming_it_and_the_server_carries_on(
    http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    with fresh_database("postgresql", tmp_path) as db:
        server = MetaServer(_config(tmp_path / "meta", db_url=db.url))
        await server.start()
        try:
            await _register(http, server, group="b1")
            db.drop()
            async with http.post(f"{server.url}/meta/register", json=_body(group="b2")) as resp:
                assert resp.status == 503
                error = (await resp.json())["error"]
            assert error.startswith(f"meta store {db.url!r}: cannot save a server: ")
            assert db.name in error
            # What memory holds is still served; a failed write left no half-registered server.
            view = await _address(http, server)
            assert [g["group"] for g in view["broker_groups"]] == ["b1"]
            async with http.get(f"{server.url}/health") as resp:
                assert resp.status == 200
        finally:
            await server.stop()


def _without(name: str) -> dict[str, Any]:
    body = _body()
    del body[name]
    return body


@pytest.mark.parametrize(
    ("payload", "field", "text"),
    [
        (b"{not json", "body", "not JSON"),
        (b"\xff\xfe", "body", "not JSON"),
        (b"[" * 5000 + b"]" * 5000, "body", "nests JSON arrays or objects too deeply"),
        (b"[1, 2]", "body", "must be a JSON object, got list"),
        *[(_without(name), name, f"{name} is missing") for name in ("role", "group", "address", "http", "pid")],
        (_body(role="consumer"), "role", "role 'consumer' is not allowed; use one of 'broker', 'delay'"),
        (_body(group=""), "group", "group must not be empty"),
        (_body(group="a/b"), "group", "group 'a/b' contains '/'"),
        (_body(address="localhost"), "address", "address 'localhost' is not \"host:port\""),
        (_body(address="h:0"), "address", "port from 1 to 65535"),
        (_body(address=20881), "address", "address must be a string"),
        (_body(http="h:http"), "http", "http 'h:http' is not \"host:port\""),
        (_body(pid=True), "pid", "pid must be a positive whole number"),
        (_body(pid=-1), "pid", "got -1"),
        (_body(pid="42"), "pid", "got '42'"),
        (_body(role_in_group="leader"), "role_in_group", "role_in_group 'leader' is not allowed"),
    ],
)
async def test_a_bad_register_body_is_refused_with_400_naming_the_field(
    http: aiohttp.ClientSession, server: MetaServer, payload: bytes | dict[str, Any], field: str, text: str
) -> None:
    kwargs: dict[str, Any] = {"data": payload} if isinstance(payload, bytes) else {"json": payload}
    async with http.post(f"{server.url}/meta/register", **kwargs) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["field"] == field
    assert text in error["error"]
    assert (await _address(http, server))["broker_groups"] == []


async def test_unknown_register_fields_are_ignored(http: aiohttp.ClientSession, server: MetaServer) -> None:
    await _register(http, server, epoch=3)
    assert len((await _address(http, server))["broker_groups"]) == 1


@pytest.mark.parametrize(
    ("subject", "text"),
    [
        ("", "subject must not be empty"),
        ("a b", "subject 'a b' contains ' '"),
        ("x" * 101, "has 101 characters; the limit is 100"),
        ("%RETRY%nogroup", "is not a valid %RETRY%<subject>%<group>"),
    ],
)
async def test_an_invalid_subject_is_refused_with_400_naming_it(
    http: aiohttp.ClientSession, server: MetaServer, subject: str, text: str
) -> None:
    async with http.get(server.meta_server_url, params=[("subject", "fine"), ("subject", subject)]) as resp:
        assert resp.status == 400
        error = await resp.json()
    assert error["field"] == "subject"
    assert text in error["error"]


async def test_subjects_per_request_are_bounded_and_the_most_allowed_fit_a_request(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    params = [("subject", f"s{i}") for i in range(SUBJECTS_PER_REQUEST_MAX + 1)]
    async with http.get(server.meta_server_url, params=params) as resp:
        assert resp.status == 400
        assert f"the limit is {SUBJECTS_PER_REQUEST_MAX}" in (await resp.json())["error"]
    # The most subjects allowed, each as long as allowed, fit in one request line.
    params = [("subject", f"{i:03d}" + "s" * 97) for i in range(SUBJECTS_PER_REQUEST_MAX)]
    async with http.get(server.meta_server_url, params=params) as resp:
        assert resp.status == 200


async def test_unknown_paths_wrong_methods_and_huge_bodies_get_json_errors(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    async with http.get(f"{server.url}/nope") as resp:
        assert (resp.status, await resp.json()) == (404, {"error": "GET /nope: Not Found"})
    async with http.get(f"{server.url}/meta/register") as resp:
        assert resp.status == 405
        assert resp.headers["Allow"] == "POST"
        assert "Method Not Allowed" in (await resp.json())["error"]
    async with http.post(f"{server.url}/meta/register", data=b"{" + b" " * 20_000 + b"}") as resp:
        assert resp.status == 413
        assert "error" in await resp.json()


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_are_prometheus_text_counting_requests_registrations_groups_and_routes(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _register(http, server, group="b1", port=20881)
    await _register(http, server, group="b1", port=20881)
    await _register(http, server, group="d1", port=30881, role="delay")
    await _address(http, server, "s1", "s2")
    async with http.get(server.meta_server_url, params={"subject": "bad subject"}) as resp:
        assert resp.status == 400

    async with http.get(f"{server.url}/metrics") as resp:
        assert resp.status == 200
        assert resp.content_type == "text/plain"
        samples = _samples(await resp.text())

    assert samples[("qmq_meta_http_requests_total", (("path", "/meta/register"), ("status", "200")))] == 3
    assert samples[("qmq_meta_http_requests_total", (("path", "/meta/address"), ("status", "200")))] == 1
    assert samples[("qmq_meta_http_requests_total", (("path", "/meta/address"), ("status", "400")))] == 1
    assert samples[("qmq_meta_registrations_total", (("role", "broker"),))] == 1
    assert samples[("qmq_meta_registrations_total", (("role", "delay"),))] == 1
    assert samples[("qmq_meta_heartbeats_total", (("role", "broker"),))] == 1
    assert samples[("qmq_meta_heartbeats_total", (("role", "delay"),))] == 0
    assert samples[("qmq_meta_groups", (("role", "broker"), ("state", "available")))] == 1
    assert samples[("qmq_meta_groups", (("role", "broker"), ("state", "unavailable")))] == 0
    assert samples[("qmq_meta_groups", (("role", "delay"), ("state", "available")))] == 1
    assert samples[("qmq_meta_subjects", ())] == 2
    assert samples[("qmq_meta_routes", ())] == 2


async def test_two_servers_in_one_process_keep_their_own_state_and_metrics(
    http: aiohttp.ClientSession, tmp_path: Path, clock: ManualClock
) -> None:
    a = MetaServer(_config(tmp_path / "a"), clock)
    b = MetaServer(_config(tmp_path / "b"), clock)
    await a.start()
    await b.start()
    try:
        assert a.port != b.port
        await _register(http, a, group="only-on-a")
        assert len((await _address(http, a))["broker_groups"]) == 1
        assert (await _address(http, b))["broker_groups"] == []
        async with http.get(f"{b.url}/metrics") as resp:
            samples = _samples(await resp.text())
        assert samples[("qmq_meta_registrations_total", (("role", "broker"),))] == 0
    finally:
        await a.stop()
        await b.stop()


@pytest.fixture
def busy_port() -> Iterator[int]:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield sock.getsockname()[1]


async def test_start_fails_clearly_when_the_port_is_in_use(tmp_path: Path, busy_port: int) -> None:
    s = MetaServer(_config(tmp_path / "meta", port=busy_port))
    with pytest.raises(MetaStartupError, match=rf"cannot listen on 127.0.0.1:{busy_port}: the port is in use"):
        await s.start()
    await s.stop()


async def test_start_fails_clearly_when_the_data_dir_is_unusable(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    s = MetaServer(_config(tmp_path / "file"))
    with pytest.raises(MetaStartupError, match=r"data_dir '.*file' cannot be used"):
        await s.start()


async def test_stop_is_idempotent_and_a_second_start_is_refused(tmp_path: Path) -> None:
    s = MetaServer(_config(tmp_path / "meta"))
    await s.start()
    with pytest.raises(RuntimeError, match="called twice"):
        await s.start()
    await s.stop()
    await s.stop()
