"""Sending through the HTTP gateway: a real `qmq standalone` (whose gateway the test posts to)
and a `qmq gateway` started on its own; what was sent is read back with the Python SDK."""

from __future__ import annotations

import asyncio
import base64
import io
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from qmq.aio import Consumer
from qmq.testing import ReadyProcess, running_gateway

pytestmark = [pytest.mark.integration]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30)) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, doc: object) -> tuple[int, Any]:
    async with http.post(url, json=doc) as resp:
        return resp.status, await resp.json()


async def drain(meta_server: str, subject: str, count: int, pulls_max: int = 50) -> list[Any]:
    group = f"g{uuid.uuid4().hex[:8]}"
    got: list[Any] = []
    async with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pc = consumer.pull_consumer(subject, group, "earliest")
        for _ in range(pulls_max):
            batch = await pc.pull(100, 200)
            got.extend((m.message_id, m.body, m.properties, m.tags, m.times) for m in batch)
            batch.ack_all()
            if len(got) >= count:
                break
    return got


@pytest.mark.smoke
async def test_the_standalone_ready_line_names_its_gateway_and_a_send_is_stored(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    url = f"{shared_standalone.gateway}/v1/subjects/{subject}/messages"
    status, doc = await post(
        http, url, {"body": "héllo", "properties": {"order": 7, "paid": True}, "tags": ["a"], "message_id": "m-1"}
    )
    assert (status, doc) == (200, {"message_id": "m-1"})
    status, doc = await post(http, url, {"body_base64": base64.b64encode(b"\xff\x00").decode()})
    assert status == 200
    second = doc["message_id"]
    got = await drain(shared_standalone.meta_server, subject, 2)
    assert [(i, b, p, t) for i, b, p, t, _ in got] == [
        ("m-1", "héllo".encode(), {"order": 7, "paid": True}, ("a",)),
        (second, b"\xff\x00", {}, ()),
    ]


async def test_a_batch_answers_one_result_per_message_and_a_repeated_id_is_stored_once(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    url = f"{shared_standalone.gateway}/v1/subjects/{subject}/messages"
    batch = {"messages": [{"body": f"m{i}", "message_id": f"id-{i}"} for i in range(100)]}
    status, doc = await post(http, url, batch)
    assert status == 200
    assert doc == {"results": [{"message_id": f"id-{i}"} for i in range(100)]}
    # the client did not see the answer and sends again: the broker's duplicate window drops it
    status, _ = await post(http, url, batch)
    assert status == 200
    status, _ = await post(http, url, {"body": "last", "message_id": "id-last"})
    got = await drain(shared_standalone.meta_server, subject, 101)
    assert [i for i, *_ in got] == [f"id-{i}" for i in range(100)] + ["id-last"]


async def test_batches_past_the_producers_buffer_wait_for_room_and_are_all_stored(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    # 16 batches of 1,000 at once: more than the gateway producer's buffer of 10,000 messages, so
    # some messages are buffered at once and the rest wait for room, as `await producer.send` does
    url = f"{shared_standalone.gateway}/v1/subjects/{subject}/messages"

    async def batch(b: int) -> tuple[int, Any]:
        return await post(http, url, {"messages": [{"body": "x", "message_id": f"b{b}-{i}"} for i in range(1000)]})

    answers = await asyncio.gather(*(batch(b) for b in range(16)))
    for b, (status, doc) in enumerate(answers):
        assert status == 200, doc
        assert doc == {"results": [{"message_id": f"b{b}-{i}"} for i in range(1000)]}
    got = await drain(shared_standalone.meta_server, subject, 16_000, pulls_max=400)
    assert len({i for i, *_ in got}) == 16_000


async def test_a_gateway_of_its_own_serves_and_bad_input_is_answered_as_json(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    with running_gateway(shared_standalone.meta_server) as gw:
        assert gw.gateway.startswith("http://127.0.0.1:")
        status, doc = await post(http, f"{gw.gateway}/v1/subjects/{subject}/messages", {"body": "x"})
        assert status == 200
        assert doc["message_id"]
        status, doc = await post(http, f"{gw.gateway}/v1/subjects/bad%20subject/messages", {"body": "x"})
        assert status == 400
        assert doc["error"]["code"] == "SUBJECT_INVALID"
        assert "bad subject" in doc["error"]["message"]
        status, doc = await post(http, f"{gw.gateway}/v1/nowhere", {})
        assert status == 404
        assert doc["error"]["code"] == "NOT_FOUND"
        async with http.post(f"{gw.gateway}/v1/subjects/{subject}/messages", data=b"{not json") as resp:
            assert resp.status == 400
            assert (await resp.json())["error"]["code"] == "BODY_INVALID"
        status, doc = await post(http, f"{gw.gateway}/v1/subjects/{subject}/messages", {"body": 3})
        assert status == 400
        assert "body_base64" in doc["error"]["message"]
        big = json.dumps({"body_base64": base64.b64encode(b"x" * (4 * 1024 * 1024 + 1)).decode()}).encode()
        async with http.post(f"{gw.gateway}/v1/subjects/{subject}/messages", data=io.BytesIO(big)) as resp:
            doc = await resp.json()
            assert resp.status == 413
            assert "body_bytes_max" in doc["error"]["message"]
    assert gw.exit_code == 0
