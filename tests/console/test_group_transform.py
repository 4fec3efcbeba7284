"""`qmq group transform` against a real `qmq standalone` and its gateway: the group's gateway pulls
get the expression's result as the body, a message it cannot evaluate goes to the group's dead
letters with the reason (and the pull goes on), another group gets the stored body, a bad
expression is refused naming the position, and clearing it gives the stored bodies again."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from tests.cli.test_cli_client_commands import qmq
from tests.gateway.gatewayhelpers import get, post, pull_until
from tests.gateway.pushhelpers import push_add, running_receiver

from qmq.common.config import meta_base_url
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

_APPLIED_S = 1.0  # what a gateway takes at most to apply a transform (qmq.gateway.transforms)


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


def _transform(subject: str, meta_server: str, group: str, *args: str) -> str:
    out = qmq("group", "transform", subject, "--group", group, *args, meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    return out.stdout


async def test_a_transformed_group_gets_the_result_as_body(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    meta, gw = shared_standalone.meta_server, shared_standalone.gateway
    group, other = f"t{uuid.uuid4().hex[:8]}", f"o{uuid.uuid4().hex[:8]}"
    said = _transform(subject, meta, group, "--expr", "{id: body.order_id, eu: properties.region == 'eu'}")
    assert f"transform set: {subject} for group {group}" in said
    status, controls = await get(http, f"{meta_base_url(meta)}/meta/controls")
    assert status == 200
    assert [subject, group, "{id: body.order_id, eu: properties.region == 'eu'}"] in controls["transforms"], controls
    await asyncio.sleep(_APPLIED_S)  # the promise: applied by every gateway within a second
    sent = {
        "messages": [
            {"body": json.dumps({"order_id": 7, "amount": 5}), "properties": {"region": "eu"}, "message_id": "a"},
            {"body": "not json", "message_id": "b"},
            {"body": json.dumps({"order_id": 9}), "properties": {"region": "us"}, "message_id": "c"},
        ]
    }
    assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", sent))[0] == 200
    got = await pull_until(http, f"{gw}/v1/subjects/{subject}/groups/{group}/pull", 2, 20, start_from="earliest")
    assert [(m["message_id"], json.loads(m["body"])) for m in got] == [
        ("a", {"id": 7, "eu": True}),
        ("c", {"id": 9, "eu": False}),
    ]
    assert got[0]["properties"] == {"region": "eu"}  # only the body is transformed
    status, doc = await post(http, f"{gw}/v1/acks", {"acks": [m["receipt"] for m in got]})
    assert status == 200
    assert [r["status"] for r in doc["results"]] == ["acked", "acked"]
    # the one it cannot evaluate is in the group's dead letters, with the reason
    deadline = time.monotonic() + 10
    letters: list[dict[str, object]] = []
    while not letters and time.monotonic() < deadline:
        dead = qmq("dead-letters", subject, "--group", group, "--json", meta_server=meta)
        assert dead.returncode == 0, dead.stderr
        letters = json.loads(dead.stdout)["letters"]
    assert [x["message_id"] for x in letters] == ["b"], letters
    assert "the group's transform" in str(letters[0]["error"]), letters
    assert "cannot evaluate it" in str(letters[0]["error"]), letters
    # another group gets the stored bodies
    plain = await pull_until(http, f"{gw}/v1/subjects/{subject}/groups/{other}/pull", 3, 20, start_from="earliest")
    assert [m["body"] for m in plain][1] == "not json"
    assert json.loads(plain[0]["body"]) == {"order_id": 7, "amount": 5}

    # cleared: stored bodies again
    assert "transform cleared" in _transform(subject, meta, group, "--clear")
    await asyncio.sleep(_APPLIED_S)
    one = {"body": json.dumps({"order_id": 1}), "message_id": "d"}
    assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", one))[0] == 200
    again = await pull_until(http, f"{gw}/v1/subjects/{subject}/groups/{group}/pull", 1, 20)
    assert [json.loads(m["body"]) for m in again] == [{"order_id": 1}]


def test_an_invalid_transform_is_refused_naming_the_position(meta_server: str, subject: str) -> None:
    out = qmq("group", "transform", subject, "--group", "g", "--expr", "{id: body.id", meta_server=meta_server)
    assert out.returncode != 0
    assert "invalid transform" in out.stderr, out.stderr
    assert "position 12" in out.stderr, out.stderr
    out = qmq("group", "transform", subject, "--group", "g", "--expr", "a" * 5000, meta_server=meta_server)
    assert "the limit is 4096" in out.stderr, out.stderr
    out = qmq("group", "transform", subject, "--group", "g", meta_server=meta_server)
    assert "give either --expr" in out.stderr, out.stderr


async def test_a_push_subscription_delivers_the_transformed_body(tmp_path: Path, subject: str) -> None:
    with running_standalone(tmp_path / "qmq-data") as proc:
        meta, gw = proc.meta_server, proc.gateway
        async with running_receiver() as rx, aiohttp.ClientSession() as http:
            push_add(subject, "hook", rx.url, meta_server=meta)
            _transform(subject, meta, "hook", "--expr", "{order: body.order_id}")
            await asyncio.sleep(_APPLIED_S)
            sent = {
                "messages": [
                    {"body": json.dumps({"order_id": 1}), "message_id": "p1"},
                    {"body": "not json", "message_id": "p2"},
                    {"body": json.dumps({"order_id": 3}), "message_id": "p3"},
                ]
            }
            assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", sent))[0] == 200
            await rx.wait_until("two deliveries", lambda: len(rx.ok()) == 2)
            delivered = {d.message_id: json.loads(d.doc["body"]) for d in rx.ok()}
            assert delivered == {"p1": {"order": 1}, "p3": {"order": 3}}
            deadline = time.monotonic() + 20
            letters: list[dict[str, object]] = []
            while not letters and time.monotonic() < deadline:
                dead = qmq("dead-letters", subject, "--group", "hook", "--json", meta_server=meta)
                letters = json.loads(dead.stdout)["letters"]
            assert [x["message_id"] for x in letters] == ["p2"], letters
            assert "cannot evaluate it" in str(letters[0]["error"]), letters
            assert len(rx.deliveries) == 2  # the one it cannot evaluate was never POSTed, not even once
