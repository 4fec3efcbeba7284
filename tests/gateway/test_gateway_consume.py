"""Consuming through the HTTP gateway of a real `qmq standalone`: long polls with receipts, acks
answered once recorded, nacks to retry, the ack timeout giving a message back (times + 1),
and the listings (subjects, lag, dead letters)."""

from __future__ import annotations

import asyncio
import base64
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from gatewayhelpers import get, post, pull_until

from qmq.aio import Consumer, Message, Producer
from qmq.testing import ReadyProcess, running_gateway

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def group() -> str:
    return f"g{uuid.uuid4().hex[:8]}"


async def test_pull_ack_and_nothing_comes_again(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    sent = {"messages": [{"body": f"m{i}", "message_id": f"id-{i}", "tags": ["t"]} for i in range(5)]}
    sent["messages"].append({"body_base64": base64.b64encode(b"\xff\xfe").decode(), "message_id": "id-bin"})
    assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", sent))[0] == 200
    pull_url = f"{gw}/v1/subjects/{subject}/groups/{group}/pull"
    got = await pull_until(http, pull_url, 6, 20, start_from="earliest", consumer_id="node-1")
    assert [m["message_id"] for m in got] == [f"id-{i}" for i in range(5)] + ["id-bin"]
    assert got[0]["body"] == "m0"
    assert got[0]["tags"] == ["t"]
    assert got[0]["times"] == 1
    assert got[0]["subject"] == subject
    assert got[0]["properties"] == {}
    assert "body" not in got[5]
    assert base64.b64decode(got[5]["body_base64"]) == b"\xff\xfe"
    receipts = [m["receipt"] for m in got]
    assert len(set(receipts)) == 6

    status, doc = await post(http, f"{gw}/v1/acks", {"acks": receipts})
    assert status == 200
    assert [r["status"] for r in doc["results"]] == ["acked"] * 6
    # the same acks again (a client that lost the answer): still acked
    status, doc = await post(http, f"{gw}/v1/acks", {"acks": receipts[:2]})
    assert [r["status"] for r in doc["results"]] == ["acked", "acked"]
    # the broker recorded them: nothing unacked, and nothing comes again
    status, lag = await get(http, f"{gw}/v1/subjects/{subject}/groups/{group}/lag")
    assert status == 200
    assert (lag["backlog"], lag["unacked"]) == (0, 0)
    status, doc = await post(http, pull_url, {"timeout_ms": 300})
    assert (status, doc) == (200, {"messages": []})

    status, listing = await get(http, f"{gw}/v1/subjects")
    assert status == 200
    [entry] = [s for s in listing["subjects"] if s["subject"] == subject]
    assert entry["messages"] == 6
    assert group in entry["consumer_groups"]


async def test_a_message_not_acked_in_time_comes_again_with_times_plus_one(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    await post(http, f"{gw}/v1/subjects/{subject}/messages", {"body": "slow", "message_id": "id-slow"})
    pull_url = f"{gw}/v1/subjects/{subject}/groups/{group}/pull"
    [first] = await pull_until(http, pull_url, 1, 20, start_from="earliest", ack_timeout_ms=1000)
    assert first["times"] == 1
    # not acked: after its ack timeout it goes back to the group and comes again
    [again] = await pull_until(http, pull_url, 1, 30, ack_timeout_ms=60_000)
    assert (again["message_id"], again["times"], again["body"]) == ("id-slow", 2, "slow")
    _status, doc = await post(http, f"{gw}/v1/acks", {"acks": [first["receipt"], again["receipt"]]})
    assert [r["status"] for r in doc["results"]] == ["expired", "acked"]
    _status, doc = await post(http, pull_url, {"timeout_ms": 1500})
    assert doc == {"messages": []}


async def test_a_nacked_message_comes_back_after_the_back_off(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    await post(http, f"{gw}/v1/subjects/{subject}/messages", {"body": "fails once", "message_id": "id-n"})
    pull_url = f"{gw}/v1/subjects/{subject}/groups/{group}/pull"
    [first] = await pull_until(http, pull_url, 1, 20, start_from="earliest")
    status, doc = await post(http, f"{gw}/v1/acks", {"nacks": [first["receipt"]]})
    assert (status, doc["results"]) == (200, [{"receipt": first["receipt"], "status": "nacked"}])
    [again] = await pull_until(http, pull_url, 1, 40)
    assert (again["message_id"], again["times"]) == ("id-n", 2)
    assert (await post(http, f"{gw}/v1/acks", {"acks": [again["receipt"]]}))[1]["results"][0]["status"] == "acked"


async def test_two_clients_pulling_one_group_share_its_messages(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    pull_url = f"{gw}/v1/subjects/{subject}/groups/{group}/pull"
    # the group starts at the latest message: pull once so it exists, then send
    assert (await post(http, pull_url, {"timeout_ms": 0}))[0] == 200
    batch = {"messages": [{"body": str(i), "message_id": f"c-{i}"} for i in range(200)]}
    assert (await post(http, f"{gw}/v1/subjects/{subject}/messages", batch))[0] == 200
    a, b = await asyncio.gather(
        pull_until(http, pull_url, 200, 5, max_messages=7), pull_until(http, pull_url, 200, 5, max_messages=7)
    )
    ids = [m["message_id"] for m in a + b]
    assert sorted(ids) == sorted(f"c-{i}" for i in range(200))
    _status, doc = await post(http, f"{gw}/v1/acks", {"acks": [m["receipt"] for m in a + b]})
    assert all(r["status"] == "acked" for r in doc["results"])


async def test_dead_letters_are_listed_resent_and_purged(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    gw, meta = shared_standalone.gateway, shared_standalone.meta_server
    async with Producer(app_code="test", meta_server=meta) as producer:
        for i in range(2):
            await producer.send(_message(subject, f"dead-{i}"))
    async with Consumer(app_code="test", meta_server=meta) as consumer:
        pc = consumer.pull_consumer(subject, group, "earliest", max_retries=0)
        failed = 0
        for _ in range(50):
            for m in await pc.pull(10, 200):
                await m.nack(RuntimeError("boom"))
                failed += 1
            if failed == 2:
                break
    dead_url = f"{gw}/v1/subjects/{subject}/groups/{group}/dead-letters"
    status, doc = await get(http, dead_url)
    assert status == 200
    assert doc["total"] == 2
    assert sorted(letter["message_id"] for letter in doc["letters"]) == ["dead-0", "dead-1"]
    assert "boom" in doc["letters"][0]["error"]
    status, doc = await post(http, f"{dead_url}/resend", {"message_id": "dead-0"})
    assert (status, doc) == (200, {"resent": 1})
    status, doc = await post(http, f"{dead_url}/purge", {"all": True})
    assert (status, doc) == (200, {"purged": 1})
    assert (await get(http, dead_url))[1]["total"] == 0
    status, doc = await post(http, f"{dead_url}/purge", {})
    assert status == 400
    assert doc["error"]["code"] == "BODY_INVALID"


def _message(subject: str, message_id: str) -> Message:
    return Message(subject, message_id=message_id, body=b"x")


async def test_bad_pulls_and_acks_are_answered_with_what_to_send(
    shared_standalone: ReadyProcess, subject: str, http: aiohttp.ClientSession
) -> None:
    gw = shared_standalone.gateway
    status, doc = await post(http, f"{gw}/v1/subjects/{subject}/groups/g/pull", {"max_messages": 5000})
    assert status == 400
    assert "1 to 1000" in doc["error"]["message"]
    status, doc = await post(http, f"{gw}/v1/subjects/{subject}/groups/g/pull", {"ack_timeout_ms": 10})
    assert status == 400
    assert "ack_timeout_ms" in doc["error"]["message"]
    status, doc = await post(http, f"{gw}/v1/subjects/{subject}/groups/g/pull", {"wait": 1})
    assert status == 400
    assert "unknown key" in doc["error"]["message"]
    assert await post(http, f"{gw}/v1/acks", {}) == (200, {"results": []})
    status, doc = await post(http, f"{gw}/v1/acks", {"ack": ["x"]})
    assert status == 400
    assert doc["error"]["code"] == "BODY_INVALID"
    status, doc = await post(http, f"{gw}/v1/acks", {"acks": [1]})
    assert status == 400
    status, doc = await get(http, f"{gw}/v1/subjects/{subject}/groups/never/lag")
    assert status == 404
    assert doc["error"]["code"] in ("SUBJECT_UNKNOWN", "GROUP_UNKNOWN")


async def test_what_a_stopped_gateway_handed_out_is_acked_through_its_restarted_self(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    key = {"QMQ_RECEIPT_KEY": "key-of-a-restarted-gateway-0123456789"}
    await post(http, f"{shared_standalone.gateway}/v1/subjects/{subject}/messages", {"body": "x", "message_id": "held"})
    with running_gateway(shared_standalone.meta_server, key) as gw:
        pull_url = f"{gw.gateway}/v1/subjects/{subject}/groups/{group}/pull"
        [first] = await pull_until(http, pull_url, 1, 20, start_from="earliest", ack_timeout_ms=600_000)
        assert first["times"] == 1
    assert gw.exit_code == 0
    # a rolling restart: the client still works on it, and acks through the new process
    with running_gateway(shared_standalone.meta_server, key) as gw:
        status, doc = await post(http, f"{gw.gateway}/v1/acks", {"acks": [first["receipt"]]})
        assert (status, doc["results"][0]["status"]) == (200, "acked")
        status, doc = await post(http, f"{gw.gateway}/v1/subjects/{subject}/groups/{group}/pull", {"timeout_ms": 500})
        assert doc == {"messages": []}


async def test_past_receipts_max_pulls_go_on_and_a_nack_of_a_message_no_longer_kept_waits_the_back_off(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    # the broker keeps the ack timeouts: a gateway keeps at most receipts_max pulled messages itself (for a
    # nack with the group's back-off), and past it forgets the oldest instead of refusing pulls
    batch = {"messages": [{"body": str(i), "message_id": f"k{i}"} for i in range(3)]}
    assert (await post(http, f"{shared_standalone.gateway}/v1/subjects/{subject}/messages", batch))[0] == 200
    with running_gateway(shared_standalone.meta_server, None, "--receipts-max", "2") as gw:
        pull_url = f"{gw.gateway}/v1/subjects/{subject}/groups/{group}/pull"
        got = await pull_until(http, pull_url, 3, 20, start_from="earliest")
        assert sorted(m["message_id"] for m in got) == ["k0", "k1", "k2"]
        _status, health = await get(http, f"{gw.gateway}/health")
        assert health["held"] == 2
        # the first one is no longer kept: its nack reads it back from the broker and it still waits the
        # group's back-off (5 s for a first failure) before it comes again
        first = next(m for m in got if m["message_id"] == "k0")
        status, doc = await post(http, f"{gw.gateway}/v1/acks", {"nacks": [first["receipt"]]})
        assert (status, doc["results"][0]["status"]) == (200, "nacked")
        assert await pull_until(http, pull_url, 1, 3) == []
        [again] = await pull_until(http, pull_url, 1, 40)
        assert (again["message_id"], again["times"]) == ("k0", 2)
        others = [m["receipt"] for m in got if m["message_id"] != "k0"]
        status, doc = await post(http, f"{gw.gateway}/v1/acks", {"acks": [*others, again["receipt"]]})
        assert [r["status"] for r in doc["results"]] == ["acked"] * 3
