"""A whole cluster with TLS and auth on every role — meta server, broker, gateway — each role
authenticating to the others as the cluster's own app: the gateway checks the Authorization
header of each request (a send needs produce on its subject), and what is sent through it is
read back over TLS with the SDK."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator, Iterator
from contextlib import ExitStack
from typing import Any

import aiohttp
import pytest
import trustme

import qmq.aio
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.testing import ReadyProcess, running_gateway, running_role

pytestmark = pytest.mark.integration

SECRETS = {"qmq-cluster": "cluster-secret", "shop": "shop-secret"}
AUTH = f"""
[apps.qmq-cluster]
secret_hash = "{hash_secret(SECRETS["qmq-cluster"], log2_n=8)}"
cluster = true
[apps.shop]
secret_hash = "{hash_secret(SECRETS["shop"], log2_n=8)}"
produce = ["order.*"]
consume = ["order.*"]
"""


class Secure:
    def __init__(self, meta: ReadyProcess, gateway: ReadyProcess, ca: trustme.CA) -> None:
        self.meta = meta
        self.gateway = gateway
        self.ctx = ssl.create_default_context()
        ca.configure_trust(self.ctx)


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    tmp = tmp_path_factory.mktemp("secure")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    cert, key, ca_file, auth = tmp / "c.pem", tmp / "k.pem", tmp / "ca.pem", tmp / "auth.toml"
    cert.write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    auth.write_text(AUTH)
    common = ["--auth-file", str(auth), "--tls-cert", str(cert), "--tls-key", str(key)]
    env = {"SSL_CERT_FILE": str(ca_file), "QMQ_SECRET": SECRETS["qmq-cluster"]}
    with ExitStack() as stack:
        meta = stack.enter_context(
            running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0", *common], env=env)
        )
        broker_args = ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", meta.meta_server]
        stack.enter_context(running_role([*broker_args, *common, "--app-code", "qmq-cluster"], env=env))
        gateway = stack.enter_context(running_gateway(meta.meta_server, env, *common, "--app-code", "qmq-cluster"))
        yield Secure(meta, gateway, ca)


@pytest.fixture
async def http(secure: Secure) -> AsyncIterator[aiohttp.ClientSession]:
    connector = aiohttp.TCPConnector(ssl=secure.ctx)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30), connector=connector) as session:
        yield session


async def post(http: aiohttp.ClientSession, url: str, app: str | None) -> tuple[int, Any]:
    headers = {} if app is None else {"Authorization": basic_authorization(app, SECRETS[app])}
    async with http.post(url, json={"body": "via gateway"}, headers=headers) as resp:
        return resp.status, await resp.json()


async def test_the_gateway_checks_each_request(secure: Secure, http: aiohttp.ClientSession) -> None:
    assert secure.gateway.gateway.startswith("https://")
    assert secure.meta.meta_server.startswith("https://")
    status, doc = await post(http, f"{secure.gateway.gateway}/v1/subjects/order.web/messages", None)
    assert status == 401
    assert doc["error"]["code"] == "UNAUTHENTICATED"
    status, doc = await post(http, f"{secure.gateway.gateway}/v1/subjects/payment.web/messages", "shop")
    assert status == 403
    assert doc["error"]["code"] == "FORBIDDEN"
    assert (doc["error"]["app"], doc["error"]["action"], doc["error"]["subject"]) == ("shop", "produce", "payment.web")
    status, doc = await post(http, f"{secure.gateway.gateway}/v1/subjects/order.web/messages", "shop")
    assert status == 200, doc
    async with http.get(f"{secure.gateway.gateway}/health") as resp:
        assert resp.status == 200


async def test_what_the_gateway_stored_is_read_back_over_tls(secure: Secure, http: aiohttp.ClientSession) -> None:
    status, doc = await post(http, f"{secure.gateway.gateway}/v1/subjects/order.back/messages", "shop")
    assert status == 200, doc
    async with qmq.aio.Consumer(
        app_code="shop", meta_server=secure.meta.meta_server, secret=SECRETS["shop"], ssl=secure.ctx
    ) as c:
        batch = await c.pull_consumer("order.back", "g", start_from="earliest").pull(10, 5000)
        assert [m.message_id for m in batch] == [doc["message_id"]]
        assert [m.body for m in batch] == [b"via gateway"]
