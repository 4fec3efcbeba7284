"""A broker with an auth file, against real processes: apps authenticate once per connection,
each request is checked against what its app may do, AuthError comes back as itself and names
the app, the action and the subject, denials are counted, and SIGHUP reloads the file without
dropping connections."""

from __future__ import annotations

import asyncio
import json
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import qmq
import qmq.aio
from qmq.auth.handshake import ClientCredentials
from qmq.auth.secrets import hash_secret
from qmq.client.connection import Connection
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, metric_value, running_role

pytestmark = pytest.mark.integration

SECRETS = {"shop": "shop-secret", "ops": "ops-secret", "other": "other-secret"}
# a cheap scrypt cost keeps the tests quick; the default is 2**14
HASHES = {app: hash_secret(secret, log2_n=8) for app, secret in SECRETS.items()}


def auth_text(shop_produce: str = '["order.*"]') -> str:
    return f"""
[apps.shop]
secret_hash = "{HASHES["shop"]}"
produce = {shop_produce}
consume = ["order.*:billing"]
[apps.ops]
secret_hash = "{HASHES["ops"]}"
admin = true
[apps.other]
secret_hash = "{HASHES["other"]}"
produce = ["other.*"]
"""


class Cluster:
    def __init__(self, meta_server: str, broker: ReadyProcess, auth_file: Path) -> None:
        self.meta_server = meta_server
        self.broker = broker
        self.auth_file = auth_file

    def broker_doc(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.meta_server, timeout=5) as resp:
            doc: dict[str, Any] = json.loads(resp.read())
        [group] = doc["broker_groups"]
        assert isinstance(group, dict)
        return group

    def denials(self, reason: str) -> float:
        return metric_value(self.broker_doc()["http"], "qmq_auth_denials_total", reason=reason)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("auth")
    auth_file = tmp / "auth.toml"
    auth_file.write_text(auth_text())
    with running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0"]) as meta:
        url = meta.meta_server
        with running_role(
            ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", url, "--auth-file", str(auth_file)]
        ) as broker:
            yield Cluster(url, broker, auth_file)


def producer(cluster: Cluster, app: str, secret: str | None) -> qmq.aio.Producer:
    return qmq.aio.Producer(app_code=app, meta_server=cluster.meta_server, secret=secret, send_timeout_ms=5000)


async def test_the_right_app_sends_and_consumes(cluster: Cluster) -> None:
    async with producer(cluster, "shop", SECRETS["shop"]) as p:
        msg = p.generate_message("order.created")
        msg.body = b"paid"
        await p.send(msg)
    async with qmq.aio.Consumer(app_code="shop", meta_server=cluster.meta_server, secret=SECRETS["shop"]) as c:
        pull = c.pull_consumer("order.created", "billing", start_from="earliest")
        batch = await pull.pull(max_messages=10, timeout_ms=5000)
        assert [m.body for m in batch] == [b"paid"]
        batch[0].ack()


async def test_a_producer_authenticates_at_start_not_at_its_first_send(cluster: Cluster) -> None:
    async with producer(cluster, "shop", SECRETS["shop"]) as p:
        assert p._open is not None
        [conn] = p._open.pool._connections.values()  # opened by start, before any send
        connecting = conn._connecting
        assert connecting is not None
        await asyncio.wait_for(asyncio.shield(connecting), 10)
        assert conn.connected
        msg = p.generate_message("order.early")
        msg.body = b"x"
        await p.send(msg)
        assert conn.incarnations == 1  # the send used the connection start made


async def test_a_wrong_secret_is_an_auth_error_as_itself(cluster: Cluster) -> None:
    before = cluster.denials("handshake")
    async with producer(cluster, "shop", "not-the-secret") as p:
        started = time.monotonic()
        with pytest.raises(qmq.AuthError) as info:
            await p.send(p.generate_message("order.created"))
        assert time.monotonic() - started < 4  # refused, not retried until send_timeout_ms
    err = info.value
    assert not isinstance(err, qmq.SendError)
    assert (err.app_code, err.action) == ("shop", "authenticate")
    assert str(err) == "app 'shop' could not authenticate: unknown app or wrong secret"
    assert cluster.denials("handshake") == before + 1


async def test_an_unknown_app_is_told_the_same(cluster: Cluster) -> None:
    async with producer(cluster, "nobody", "guess") as p:
        with pytest.raises(qmq.AuthError, match="unknown app or wrong secret"):
            await p.send(p.generate_message("order.created"))


async def test_no_secret_is_refused_until_the_handshake(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("QMQ_SECRET", raising=False)
    before = cluster.denials("unauthenticated")
    async with producer(cluster, "shop", None) as p:
        with pytest.raises(qmq.AuthError, match="authenticate first") as info:
            await p.send(p.generate_message("order.created"))
    assert info.value.action == "authenticate"
    assert cluster.denials("unauthenticated") == before + 1


async def test_the_secret_from_the_environment(cluster: Cluster, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QMQ_SECRET", SECRETS["shop"])
    async with producer(cluster, "shop", None) as p:
        await p.send(p.generate_message("order.env"))


async def test_a_subject_the_app_may_not_produce_to(cluster: Cluster) -> None:
    before = cluster.denials("forbidden")
    async with producer(cluster, "shop", SECRETS["shop"]) as p:
        with pytest.raises(qmq.AuthError) as info:
            await p.send(p.generate_message("payment.created"))
        await p.send(p.generate_message("order.still-fine"))  # the connection stays usable
    err = info.value
    assert (err.app_code, err.action, err.subject) == ("shop", "produce", "payment.created")
    assert "app 'shop' may not produce 'payment.created'" in str(err)
    assert cluster.denials("forbidden") == before + 1


async def test_a_group_the_app_may_not_consume_as(cluster: Cluster) -> None:
    async with qmq.aio.Consumer(app_code="shop", meta_server=cluster.meta_server, secret=SECRETS["shop"]) as c:
        pull = c.pull_consumer("order.created", "shipping")
        with pytest.raises(qmq.AuthError) as info:
            await pull.pull(max_messages=1, timeout_ms=100)
    assert (info.value.action, info.value.subject) == ("consume", "order.created")
    async with qmq.aio.Consumer(app_code="other", meta_server=cluster.meta_server, secret=SECRETS["other"]) as c:
        with pytest.raises(qmq.AuthError, match=r"app 'other' may not consume 'order\.created'"):
            await c.pull_consumer("order.created", "billing").pull(max_messages=1, timeout_ms=100)


async def test_admin_requests_need_an_admin_app(cluster: Cluster) -> None:
    address = cluster.broker_doc()["address"]
    header = {"subject": "order.created", "group": "billing", "to": "earliest"}
    for app, allowed in (("shop", False), ("ops", True)):
        conn = Connection(address, connect_timeout_ms=3000, credentials=credentials(app))
        try:
            if allowed:
                frame = await conn.request(RequestCode.RESET_OFFSET, dict(header))
                assert "pull_offset" in frame.header
            else:
                with pytest.raises(qmq.AuthError, match="app 'shop' may not admin") as info:
                    await conn.request(RequestCode.RESET_OFFSET, dict(header))
                assert info.value.action == "admin"
                with pytest.raises(qmq.AuthError, match="may not admin"):
                    await conn.request(RequestCode.PURGE_DEAD, {"subject": "order.created", "group": "g", "all": True})
                with pytest.raises(qmq.AuthError, match="may not cluster"):
                    await conn.request(RequestCode.REPLICATE, {"epoch": 0})
        finally:
            await conn.close()


def credentials(app: str) -> ClientCredentials:
    return ClientCredentials(app, SECRETS[app])


async def test_sighup_reloads_the_file_without_dropping_connections(cluster: Cluster) -> None:
    async with producer(cluster, "shop", SECRETS["shop"]) as p:
        with pytest.raises(qmq.AuthError):
            await p.send(p.generate_message("refund.created"))
        address = cluster.broker_doc()["address"]
        conn = p._open.pool.get(address)  # type: ignore[union-attr]
        incarnations = conn.incarnations
        try:
            cluster.auth_file.write_text(auth_text('["order.*", "refund.*"]'))
            cluster.broker.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 20
            while True:  # the reload is asynchronous to this test: poll for its effect, bounded
                try:
                    await p.send(p.generate_message("refund.created"))
                    break
                except qmq.AuthError:
                    assert time.monotonic() < deadline, "the broker did not reload its auth file on SIGHUP"
                    await asyncio.sleep(0.1)
            assert conn.incarnations == incarnations  # the same connection throughout
        finally:
            cluster.auth_file.write_text(auth_text())
            cluster.broker.proc.send_signal(signal.SIGHUP)


async def test_a_listener_the_app_may_not_run_stops_and_says_why(cluster: Cluster) -> None:
    async with qmq.aio.Consumer(app_code="shop", meta_server=cluster.meta_server, secret=SECRETS["shop"]) as c:

        async def handle(_message: qmq.aio.ReceivedMessage) -> None:
            raise AssertionError("no message may reach a listener the app may not run")

        c.add_listener("order.created", "shipping", handle)
        deadline = time.monotonic() + 20
        while not c.errors:  # the listener pulls on its own tasks: poll for its stop, bounded
            assert time.monotonic() < deadline, "the listener did not stop on the refusal"
            await asyncio.sleep(0.05)
        [error] = c.errors
        assert error.startswith("listener order.created/shipping stopped: app 'shop' may not consume")
        assert not c.listeners[0].running


async def test_a_replayed_handshake_is_refused_by_the_broker(cluster: Cluster) -> None:
    address = cluster.broker_doc()["address"]
    creds = credentials("shop")
    hello, client_nonce = creds.hello()
    first = Connection(address, connect_timeout_ms=3000)
    try:
        challenge = await first.request(RequestCode.AUTH_HELLO, dict(hello))
        proof = creds.proof(challenge.header, client_nonce)
        assert (await first.request(RequestCode.AUTH_PROOF, dict(proof))).header == {"app": "shop"}
        assert (await first.request(RequestCode.PING, {})).header["role"] == "broker"
    finally:
        await first.close()
    # what crossed the wire, sent again on another connection: the broker's nonce differs
    replay = Connection(address, connect_timeout_ms=3000)
    try:
        await replay.request(RequestCode.AUTH_HELLO, dict(hello))
        with pytest.raises(qmq.AuthError, match="could not authenticate"):
            await replay.request(RequestCode.AUTH_PROOF, dict(proof))
    finally:
        await replay.close()


async def test_one_handshake_at_a_time(cluster: Cluster) -> None:
    conn = Connection(cluster.broker_doc()["address"], connect_timeout_ms=3000)
    hello, _nonce = credentials("shop").hello()
    try:
        await conn.request(RequestCode.AUTH_HELLO, dict(hello))
        with pytest.raises(qmq.BrokerError, match="one AUTH_HELLO"):
            await conn.request(RequestCode.AUTH_HELLO, dict(hello))
    finally:
        await conn.close()


async def test_repeated_failures_slow_an_address_but_never_lock_it_out(tmp_path: Path) -> None:
    auth_file = tmp_path / "auth.toml"
    auth_file.write_text(auth_text())
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0"]) as meta:
        args = ["broker", "--data-dir", str(tmp_path / "b"), "--meta-server", meta.meta_server]
        with running_role([*args, "--auth-file", str(auth_file)]):
            group = Cluster(meta.meta_server, meta, auth_file).broker_doc()
            wrong = ClientCredentials("shop", "guess")
            for _ in range(10):  # ten failures within a minute from 127.0.0.1
                conn = Connection(group["address"], connect_timeout_ms=3000, credentials=wrong)
                with pytest.raises(qmq.AuthError):
                    await conn.request(RequestCode.PING, {})
                await conn.close()
            conn = Connection(group["address"], connect_timeout_ms=3000, credentials=credentials("shop"))
            try:
                started = time.monotonic()
                assert (await conn.request(RequestCode.PING, {})).header["role"] == "broker"  # still gets in
                assert time.monotonic() - started >= 0.1  # but its handshake was held back
            finally:
                await conn.close()
