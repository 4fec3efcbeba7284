"""TLS on every port, against real processes with certificates made at test time (trustme):
end to end through an https:// meta server, a client that does not trust the CA refused, plain
TCP to a TLS port refused cleanly, and client certificates required with --tls-ca."""

from __future__ import annotations

import json
import ssl
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

import qmq
import qmq.aio
from qmq.auth.secrets import hash_secret
from qmq.client.connection import Connection
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_role

pytestmark = pytest.mark.integration


@dataclass
class Pki:
    ca: trustme.CA
    cert: Path
    key: Path
    ca_file: Path

    def client_context(self, *, with_cert: bool = False, common_name: str = "shop") -> ssl.SSLContext:
        ctx = ssl.create_default_context()
        self.ca.configure_trust(ctx)
        if with_cert:
            self.ca.issue_cert("client.example", common_name=common_name).configure_cert(ctx)
        return ctx


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    tmp = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    cert, key, ca_file = tmp / "server.pem", tmp / "server.key", tmp / "ca.pem"
    cert.write_bytes(b"".join(blob.bytes() for blob in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(key))
    ca.cert_pem.write_to_path(str(ca_file))
    return Pki(ca, cert, key, ca_file)


@dataclass
class Cluster:
    meta: ReadyProcess
    broker: ReadyProcess

    @property
    def meta_server(self) -> str:
        return self.meta.meta_server


def start_cluster(stack: ExitStack, tmp: Path, pki: Pki, *, client_certs: bool, auth: Path | None = None) -> Cluster:
    tls = ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    if client_certs:
        tls += ["--tls-ca", str(pki.ca_file)]
    # the broker trusts the meta server's certificate through $SSL_CERT_FILE (or --tls-ca)
    env = {"SSL_CERT_FILE": str(pki.ca_file)}
    if auth is not None:  # the meta server stays open: only the broker checks apps here
        tls += ["--auth-file", str(auth)]
    meta_tls = [a for a in tls if a != "--auth-file" and a != str(auth)]
    meta = stack.enter_context(
        running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0", *meta_tls], env=env)
    )
    broker = stack.enter_context(
        running_role(
            ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", meta.meta_server, "--http-port", "0", *tls],
            env=env,
        )
    )
    return Cluster(meta, broker)


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[Cluster]:
    with ExitStack() as stack:
        yield start_cluster(stack, tmp_path_factory.mktemp("tls"), pki, client_certs=False)


def get_json(url: str, ctx: ssl.SSLContext) -> Any:
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        return json.loads(resp.read())


def get_bytes(url: str, ctx: ssl.SSLContext) -> bytes:
    with urllib.request.urlopen(url, timeout=10, context=ctx) as resp:
        body: bytes = resp.read()
    return body


def plain_http_error(url: str) -> OSError | None:
    """What a plain HTTP GET of ``url`` fails with, or None when it is answered."""
    try:
        with urllib.request.urlopen(url, timeout=10):
            return None
    except OSError as exc:
        return exc


def broker_of(cluster: Cluster, ctx: ssl.SSLContext) -> dict[str, Any]:
    [group] = get_json(cluster.meta_server, ctx)["broker_groups"]
    assert isinstance(group, dict)
    return group


async def test_tls_end_to_end(tls_cluster: Cluster, pki: Pki) -> None:
    assert tls_cluster.meta_server.startswith("https://")
    assert tls_cluster.broker.ready["http"].startswith("https://")
    ctx = pki.client_context()
    async with qmq.aio.Producer(app_code="shop", meta_server=tls_cluster.meta_server, ssl=ctx) as p:
        msg = p.generate_message("tls.order")
        msg.body = b"secret body"
        await p.send(msg)
    async with qmq.aio.Consumer(app_code="shop", meta_server=tls_cluster.meta_server, ssl=ctx) as c:
        batch = await c.pull_consumer("tls.order", "g", start_from="earliest").pull(10, 5000)
        assert [m.body for m in batch] == [b"secret body"]
    # /metrics is served over TLS too
    http = broker_of(tls_cluster, ctx)["http"]
    assert b"qmq_messages_in" in get_bytes(f"https://{http}/metrics", ctx)


async def test_a_client_that_does_not_trust_the_ca_is_refused(tls_cluster: Cluster, pki: Pki) -> None:
    stranger = ssl.create_default_context()
    trustme.CA().configure_trust(stranger)
    producer = qmq.aio.Producer(app_code="shop", meta_server=tls_cluster.meta_server, ssl=stranger)
    with pytest.raises(qmq.MetaServerError, match="CERTIFICATE_VERIFY_FAILED"):
        await producer.start()
    conn = Connection(broker_of(tls_cluster, pki.client_context())["address"], connect_timeout_ms=3000, ssl=stranger)
    try:
        with pytest.raises(qmq.ConnectionLostError, match="CERTIFICATE_VERIFY_FAILED"):
            await conn.request(RequestCode.PING, {})
    finally:
        await conn.close()


async def test_plain_tcp_to_a_tls_port_is_refused_cleanly(tls_cluster: Cluster, pki: Pki) -> None:
    ctx = pki.client_context()
    address = broker_of(tls_cluster, ctx)["address"]
    plain = Connection(address, connect_timeout_ms=3000)
    try:
        with pytest.raises(qmq.ConnectionLostError):
            await plain.request(RequestCode.PING, {})
    finally:
        await plain.close()
    # and the broker serves TLS clients as before
    tls = Connection(address, connect_timeout_ms=3000, ssl=ctx)
    try:
        assert (await tls.request(RequestCode.PING, {})).header["role"] == "broker"
    finally:
        await tls.close()
    # the meta server's HTTP port too: closed without an answer
    assert plain_http_error(tls_cluster.meta_server.replace("https://", "http://")) is not None


async def test_client_certificates_with_tls_ca(tmp_path: Path, pki: Pki) -> None:
    with ExitStack() as stack:
        cluster = start_cluster(stack, tmp_path, pki, client_certs=True)  # the broker registered with its cert
        without = qmq.aio.Producer(app_code="shop", meta_server=cluster.meta_server, ssl=pki.client_context())
        with pytest.raises(qmq.MetaServerError):
            await without.start()
        ctx = pki.client_context(with_cert=True)
        address = broker_of(cluster, ctx)["address"]
        conn = Connection(address, connect_timeout_ms=3000, ssl=pki.client_context())
        try:
            with pytest.raises(qmq.ConnectionLostError):
                await conn.request(RequestCode.PING, {})
        finally:
            await conn.close()
        async with qmq.aio.Producer(app_code="shop", meta_server=cluster.meta_server, ssl=ctx) as p:
            await p.send(p.generate_message("tls.mutual"))


async def test_a_client_certificate_stands_for_its_app(tmp_path: Path, pki: Pki) -> None:
    auth = tmp_path / "auth.toml"
    auth.write_text(f'[apps.shop]\nsecret_hash = "{hash_secret("unused", log2_n=8)}"\nproduce = ["cert.*"]\n')
    with ExitStack() as stack:
        cluster = start_cluster(stack, tmp_path, pki, client_certs=True, auth=auth)
        shop = pki.client_context(with_cert=True, common_name="shop")
        async with qmq.aio.Producer(app_code="shop", meta_server=cluster.meta_server, ssl=shop, secret="") as p:
            await p.send(p.generate_message("cert.paid"))  # no secret: the certificate says who it is
            with pytest.raises(qmq.AuthError, match=r"app 'shop' may not produce 'other\.paid'"):
                await p.send(p.generate_message("other.paid"))
        stranger = pki.client_context(with_cert=True, common_name="nobody")
        async with qmq.aio.Producer(app_code="x", meta_server=cluster.meta_server, ssl=stranger, secret="") as p:
            with pytest.raises(qmq.AuthError, match="authenticate first"):
                await p.send(p.generate_message("cert.paid"))
