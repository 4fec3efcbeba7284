"""Receipts settled by any gateway of a cluster (stateless gateways behind a load balancer):
two real `qmq gateway` processes sharing a receipt key over one `qmq standalone`.

- pulled on one, acked on the other: answered acked, and never delivered again;
- pulled on one, nacked on the other: it comes back with times + 1, after the group's back-off;
- pulled on one that is then killed (SIGKILL): it comes back through the other once its ack
  timeout passed, not before;
- a forged or tampered receipt, or one signed with another key, is refused 400;
- with auth and no receipt key, gateways running as the cluster's app share a key derived from
  its secret.
"""

from __future__ import annotations

import base64
import signal
import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from gatewayhelpers import post, pull_until

from qmq.auth.secrets import hash_secret
from qmq.testing import ReadyProcess, running_gateway, running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

KEY = {"QMQ_RECEIPT_KEY": "test-receipt-key-of-this-cluster-0123456789"}


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def group() -> str:
    return f"g{uuid.uuid4().hex[:8]}"


async def _send(http: aiohttp.ClientSession, gw: str, subject: str, message_id: str) -> None:
    status, doc = await post(
        http, f"{gw}/v1/subjects/{subject}/messages", {"body": message_id, "message_id": message_id}
    )
    assert status == 200, doc


async def test_a_receipt_pulled_on_one_gateway_is_acked_on_another_and_never_comes_back(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    meta = shared_standalone.meta_server
    with running_gateway(meta, KEY) as a, running_gateway(meta, KEY) as b:
        for i in range(3):
            await _send(http, a.gateway, subject, f"lb-{i}")
        got = await pull_until(
            http, f"{a.gateway}/v1/subjects/{subject}/groups/{group}/pull", 3, 20, start_from="earliest",
            ack_timeout_ms=2_000,
        )  # fmt: skip
        assert sorted(m["message_id"] for m in got) == ["lb-0", "lb-1", "lb-2"]
        status, doc = await post(http, f"{b.gateway}/v1/acks", {"acks": [m["receipt"] for m in got]})
        assert status == 200, doc
        assert [r["status"] for r in doc["results"]] == ["acked"] * 3
        # past the ack timeout (2 s) and the issuing gateway's own give-back (3 s later): nothing comes again,
        # through either gateway
        deadline = time.monotonic() + 7
        while time.monotonic() < deadline:
            for gw in (a, b):
                status, doc = await post(
                    http, f"{gw.gateway}/v1/subjects/{subject}/groups/{group}/pull", {"timeout_ms": 500}
                )
                assert (status, doc) == (200, {"messages": []})
        # the same ack again: the gateway that recorded it says acked; the issuing one, which never saw it,
        # learns from the broker that it was settled through another gateway
        status, doc = await post(http, f"{b.gateway}/v1/acks", {"acks": [got[0]["receipt"]]})
        assert doc["results"][0]["status"] == "acked"
        status, doc = await post(http, f"{a.gateway}/v1/acks", {"acks": [got[0]["receipt"]]})
        assert doc["results"][0]["status"] == "settled"


async def test_a_receipt_nacked_on_another_gateway_comes_back_with_times_plus_one_after_the_back_off(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    meta = shared_standalone.meta_server
    with running_gateway(meta, KEY) as a, running_gateway(meta, KEY) as b:
        await _send(http, a.gateway, subject, "lb-nack")
        [first] = await pull_until(
            http, f"{a.gateway}/v1/subjects/{subject}/groups/{group}/pull", 1, 20, start_from="earliest"
        )
        status, doc = await post(http, f"{b.gateway}/v1/acks", {"nacks": [first["receipt"]]})
        nacked_at = time.monotonic()
        assert (status, doc["results"][0]["status"]) == (200, "nacked")
        [again] = await pull_until(http, f"{b.gateway}/v1/subjects/{subject}/groups/{group}/pull", 1, 40)
        assert (again["message_id"], again["times"]) == ("lb-nack", 2)
        # the group's back-off for a first failure is 5 s, whichever gateway the nack came to
        assert time.monotonic() - nacked_at >= 4.0
        assert again["body"] == "lb-nack"
        status, doc = await post(http, f"{a.gateway}/v1/acks", {"acks": [again["receipt"]]})
        assert doc["results"][0]["status"] == "acked"


async def test_a_message_pulled_through_a_killed_gateway_comes_back_after_its_ack_timeout(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    meta = shared_standalone.meta_server
    ack_timeout_ms = 4_000
    with running_gateway(meta, KEY) as b:
        with running_gateway(meta, KEY) as a:
            await _send(http, a.gateway, subject, "orphan")
            [first] = await pull_until(
                http, f"{a.gateway}/v1/subjects/{subject}/groups/{group}/pull", 1, 20, start_from="earliest",
                ack_timeout_ms=ack_timeout_ms,
            )  # fmt: skip
            pulled_at = time.monotonic()
            a.stop(signal.SIGKILL)
        pull_url = f"{b.gateway}/v1/subjects/{subject}/groups/{group}/pull"
        [again] = await pull_until(http, pull_url, 1, 30, ack_timeout_ms=60_000)
        came_after_s = time.monotonic() - pulled_at
        assert (again["message_id"], again["times"]) == ("orphan", 2)
        # the broker's hold gave it back at the deadline: not before it, and far sooner than the broker's
        # consumer_offline_ms (3 minutes) would have
        assert ack_timeout_ms / 1000 - 0.5 <= came_after_s <= ack_timeout_ms / 1000 + 10
        _status, doc = await post(http, f"{b.gateway}/v1/acks", {"acks": [again["receipt"], first["receipt"]]})
        assert [r["status"] for r in doc["results"]] == ["acked", "expired"]
        assert await post(http, pull_url, {"timeout_ms": 1_000}) == (200, {"messages": []})


def _tampered(receipt: str) -> str:
    """``receipt`` naming the next position of the same pull log, its signature kept."""
    payload, mac = receipt.split(".")
    fields = base64.urlsafe_b64decode(payload + "=" * (-len(payload) % 4)).decode().split("\n")
    fields[5] = str(int(fields[5]) + 1)
    forged = base64.urlsafe_b64encode("\n".join(fields).encode()).rstrip(b"=").decode()
    return f"{forged}.{mac}"


async def test_a_forged_or_tampered_receipt_is_refused_and_nothing_is_settled(
    shared_standalone: ReadyProcess, subject: str, group: str, http: aiohttp.ClientSession
) -> None:
    meta = shared_standalone.meta_server
    other_key = {"QMQ_RECEIPT_KEY": "another-cluster-key-0123456789abcdef"}
    with running_gateway(meta, KEY) as a, running_gateway(meta, other_key) as stranger:
        await _send(http, a.gateway, subject, "f-0")
        await _send(http, a.gateway, subject, "f-1")
        got = await pull_until(
            http, f"{a.gateway}/v1/subjects/{subject}/groups/{group}/pull", 2, 20, start_from="earliest"
        )
        good = got[0]["receipt"]
        for bad in (_tampered(good), good[:-2] + ("AA" if not good.endswith("AA") else "BB"), "nobody.1", "x"):
            status, doc = await post(http, f"{a.gateway}/v1/acks", {"acks": [got[1]["receipt"], bad]})
            assert status == 400, doc
            assert doc["error"]["code"] == "RECEIPT_INVALID"
            assert "was not issued by a gateway of this cluster" in doc["error"]["message"]
        # a gateway with another key cannot settle them
        status, doc = await post(http, f"{stranger.gateway}/v1/acks", {"acks": [good]})
        assert (status, doc["error"]["code"]) == (400, "RECEIPT_INVALID")
        # nothing of the refused requests was settled: both still ack
        status, doc = await post(http, f"{a.gateway}/v1/acks", {"acks": [m["receipt"] for m in got]})
        assert [r["status"] for r in doc["results"]] == ["acked", "acked"]


async def test_gateways_of_a_cluster_with_auth_share_a_key_derived_from_its_secret(
    tmp_path: Path, http: aiohttp.ClientSession
) -> None:
    # no receipt key given: the gateways, running as the cluster's app, derive it from its secret; their
    # SETTLE requests pass the brokers' auth gate as that app
    cluster_secret = "cluster-secret-of-this-test"
    auth_file = tmp_path / "auth.toml"
    auth_file.write_text(
        f'[apps.qmq-cluster]\nsecret_hash = "{hash_secret(cluster_secret, log2_n=8)}"\ncluster = true\n'
    )
    env = {"QMQ_SECRET": cluster_secret}
    meta_args = ["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0", "--auth-file", str(auth_file)]
    with running_role(meta_args) as meta:
        broker_args = ["broker", "--data-dir", str(tmp_path / "broker"), "--meta-server", meta.meta_server]
        broker_args += ["--auth-file", str(auth_file), "--app-code", "qmq-cluster"]
        gateway_args = ("--app-code", "qmq-cluster")
        with (
            running_role(broker_args, env=env),
            running_gateway(meta.meta_server, env, *gateway_args) as a,
            running_gateway(meta.meta_server, env, *gateway_args) as b,
        ):
            subject, group = f"auth.{uuid.uuid4().hex[:8]}", "g"
            await _send(http, a.gateway, subject, "secured")
            [m] = await pull_until(
                http, f"{a.gateway}/v1/subjects/{subject}/groups/{group}/pull", 1, 20, start_from="earliest"
            )
            status, doc = await post(http, f"{b.gateway}/v1/acks", {"acks": [m["receipt"]]})
            assert (status, doc["results"][0]["status"]) == (200, "acked")
