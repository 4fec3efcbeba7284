"""The meta server's cluster operations over HTTP (drain, routes, remove-group, history) against a
real MetaServer on 127.0.0.1 port 0: what clients and servers are told, and each refusal."""

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

WHO = "ops@test"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[MetaServer]:
    config = MetaConfig(data_dir=tmp_path / "meta", host="127.0.0.1", port=0, heartbeat_timeout_ms=30_000)
    s = MetaServer(config, ManualClock())
    await s.start()
    yield s
    await s.stop()


async def _register(
    http: aiohttp.ClientSession, server: MetaServer, group: str, port: int, unconsumed: object = None
) -> tuple[int, dict[str, Any]]:
    body: dict[str, Any] = {
        "role": "broker",
        "group": group,
        "address": f"127.0.0.1:{port}",
        "http": f"127.0.0.1:{port + 1000}",
        "pid": 4242,
        "role_in_group": "master",
        "epoch": 1,
    }
    if unconsumed is not None:
        body["unconsumed"] = unconsumed
    async with http.post(f"{server.url}/meta/register", json=body) as resp:
        return resp.status, await resp.json()


async def _post(http: aiohttp.ClientSession, server: MetaServer, path: str, body: object) -> tuple[int, Any]:
    async with http.post(f"{server.url}{path}", json=body) as resp:
        return resp.status, await resp.json()


async def _get(http: aiohttp.ClientSession, server: MetaServer, path: str) -> tuple[int, Any]:
    async with http.get(f"{server.url}{path}") as resp:
        return resp.status, await resp.json()


def _report(total: int, top: list[list[Any]], *, draining: bool) -> dict[str, Any]:
    return {"total": total, "pairs": len(top), "top": top, "draining": draining}


async def _two_groups(http: aiohttp.ClientSession, server: MetaServer) -> None:
    for group, port in (("b1", 20881), ("b2", 20891)):
        status, _ = await _register(http, server, group, port)
        assert status == 200


async def test_a_draining_group_takes_no_sends_but_keeps_its_routes_for_consumers(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _two_groups(http, server)
    _, before = await _get(http, server, "/meta/address?subject=orders")
    assert before["routes"] == {"orders": ["b1", "b2"]}
    assert before["send_routes"] == {"orders": ["b1", "b2"]}

    status, done = await _post(http, server, "/meta/drain", {"group": "b1", "by": WHO})
    assert status == 200, done
    assert (done["action"], done["target"], done["by"]) == ("drain", "b1", WHO)

    _, after = await _get(http, server, "/meta/address?subject=orders&subject=fresh")
    assert {g["group"]: g["writable"] for g in after["broker_groups"]} == {"b1": False, "b2": True}
    assert after["routes"] == {"orders": ["b1", "b2"], "fresh": ["b2"]}  # a new subject avoids b1
    assert after["send_routes"] == {"orders": ["b2"], "fresh": ["b2"]}
    _, answer = await _register(http, server, "b1", 20881)
    assert answer["draining"] is True  # its master refuses sends
    _, answer = await _register(http, server, "b2", 20891)
    assert "draining" not in answer

    # b2 is the last writable group of "fresh" and "orders": it cannot be drained too.
    status, refused = await _post(http, server, "/meta/drain", {"group": "b2"})
    assert status == 409
    assert "subject 'fresh'" in refused["error"]
    assert "qmq admin routes fresh --add GROUP" in refused["error"]
    status, refused = await _post(http, server, "/meta/drain", {"group": "b1"})
    assert status == 409
    assert "draining already" in refused["error"]

    status, _ = await _post(http, server, "/meta/undrain", {"group": "b1", "by": WHO})
    assert status == 200
    _, again = await _get(http, server, "/meta/address?subject=orders")
    assert again["send_routes"] == {"orders": ["b1", "b2"]}
    status, refused = await _post(http, server, "/meta/undrain", {"group": "b1"})
    assert status == 409
    assert "not draining" in refused["error"]


async def test_routes_are_added_and_retired_and_never_left_without_a_writable_group(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _two_groups(http, server)
    await _get(http, server, "/meta/address?subject=orders")
    status, refused = await _post(http, server, "/meta/routes", {"subject": "orders", "add": "b1"})
    assert status == 409
    assert "already" in refused["error"]
    status, refused = await _post(http, server, "/meta/routes", {"subject": "orders", "add": "b9"})
    assert status == 404
    assert "b1, b2" in refused["error"]

    status, _ = await _post(http, server, "/meta/routes", {"subject": "orders", "remove": "b1", "by": WHO})
    assert status == 200
    _, view = await _get(http, server, "/meta/routes?subject=orders")
    assert [(r["group"], r["state"]) for r in view["routes"]] == [("b1", "retiring"), ("b2", "active")]
    _, address = await _get(http, server, "/meta/address?subject=orders")
    assert address["routes"] == {"orders": ["b1", "b2"]}  # consumers still pull b1
    assert address["send_routes"] == {"orders": ["b2"]}
    status, refused = await _post(http, server, "/meta/routes", {"subject": "orders", "remove": "b2"})
    assert status == 409
    assert "no other available, writable group" in refused["error"]

    status, _ = await _post(http, server, "/meta/routes", {"subject": "orders", "add": "b1", "by": WHO})
    assert status == 200  # the retired route takes sends again
    _, address = await _get(http, server, "/meta/address?subject=orders")
    assert address["send_routes"] == {"orders": ["b1", "b2"]}


async def test_remove_group_is_refused_while_anything_is_unconsumed_then_done_for_good(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    await _two_groups(http, server)
    await _get(http, server, "/meta/address?subject=orders")
    status, refused = await _post(http, server, "/meta/remove-group", {"group": "b1"})
    assert status == 409
    assert "drain it first" in refused["error"]
    await _post(http, server, "/meta/drain", {"group": "b1", "by": WHO})

    status, refused = await _post(http, server, "/meta/remove-group", {"group": "b1"})
    assert status == 409
    assert "has not reported" in refused["error"]
    await _register(http, server, "b1", 20881, _report(7, [["orders", "billing", 7]], draining=True))
    status, refused = await _post(http, server, "/meta/remove-group", {"group": "b1"})
    assert status == 409
    assert "7 message(s)" in refused["error"]
    assert "'orders'" in refused["error"]
    assert "'billing'" in refused["error"]
    _, view = await _get(http, server, "/meta/cluster")
    [b1] = [g for g in view["groups"] if g["group"] == "b1"]
    assert (b1["operation"], b1["left"], b1["left_top"]) == ("draining", 7, [["orders", "billing", 7]])

    # Nothing left, but counted before the master refused sends: something may have come since.
    await _register(http, server, "b1", 20881, _report(0, [], draining=False))
    status, refused = await _post(http, server, "/meta/remove-group", {"group": "b1"})
    assert status == 409
    await _register(http, server, "b1", 20881, _report(0, [], draining=True))
    _, view = await _get(http, server, "/meta/cluster")
    assert [g["operation"] for g in view["groups"] if g["group"] == "b1"] == ["drained"]

    status, done = await _post(http, server, "/meta/remove-group", {"group": "b1", "by": WHO})
    assert status == 200, done
    _, view = await _get(http, server, "/meta/cluster")
    assert [g["group"] for g in view["groups"]] == ["b2"]
    assert [r["group"] for r in view["removed_groups"]] == ["b1"]
    _, address = await _get(http, server, "/meta/address?subject=orders")
    assert address["routes"] == {"orders": ["b2"]}
    status, gone = await _register(http, server, "b1", 20881)
    assert status == 410
    assert "removed for good" in gone["error"]

    _, history = await _get(http, server, "/meta/history")
    assert [(e["action"], e["target"], e["who"]) for e in history["history"]] == [
        ("drain", "b1", WHO),
        ("remove-group", "b1", WHO),
    ]


@pytest.mark.parametrize(
    ("path", "body", "field", "text"),
    [
        ("/meta/drain", [1], "body", "must be a JSON object"),
        ("/meta/drain", {}, "group", "group is missing"),
        ("/meta/drain", {"group": "b 1"}, "group", "b 1"),
        ("/meta/drain", {"group": "b1", "by": 5}, "by", "by must name who asks"),
        ("/meta/routes", {"subject": "orders"}, "add", 'one of "add": GROUP or "remove": GROUP'),
        ("/meta/routes", {"add": "b1"}, "subject", "subject"),
    ],
)
async def test_a_bad_operation_body_is_answered_400_naming_the_field(
    http: aiohttp.ClientSession, server: MetaServer, path: str, body: object, field: str, text: str
) -> None:
    status, answer = await _post(http, server, path, body)
    assert status == 400
    assert answer["field"] == field
    assert text in answer["error"]


async def test_a_malformed_unconsumed_report_or_history_limit_is_answered_400(
    http: aiohttp.ClientSession, server: MetaServer
) -> None:
    status, answer = await _register(http, server, "b1", 20881, {"total": -1, "pairs": 0, "top": []})
    assert status == 400
    assert answer["field"] == "unconsumed"
    status, answer = await _register(http, server, "b1", 20881, {"total": 1, "pairs": 1, "top": [["s", 3, 1]]})
    assert status == 400
    assert answer["field"] == "unconsumed"
    status, answer = await _get(http, server, "/meta/history?limit=0")
    assert status == 400
    assert answer["field"] == "limit"
