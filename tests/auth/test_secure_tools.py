"""The tools that talk to servers, against a cluster with an auth file and TLS on: the `qmq`
client commands that open broker connections of their own (`subjects`, `lag`,
`delay-stats`), the outbox watchdog, and a gateway's HTTP push when every port requires a
client certificate. Each takes the app (`--app-code`/$QMQ_APP_CODE), its secret
(`--secret`/$QMQ_SECRET) and the CA (`--tls-ca`/$QMQ_TLS_CA, or $SSL_CERT_FILE)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import trustme
from aiohttp import web

import qmq.aio
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.client.message import Message
from qmq.testing import ReadyProcess, running_standalone
from qmq.tx.rows import row_values
from qmq.tx.schema import DEFAULT_OUTBOX_TABLE, outbox_table

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SECRETS = {"qmq-cluster": "cluster-secret", "ops": "ops-secret", "shop": "shop-secret"}
AUTH = f"""
[apps.qmq-cluster]
secret_hash = "{hash_secret(SECRETS["qmq-cluster"], log2_n=8)}"
cluster = true
[apps.ops]
secret_hash = "{hash_secret(SECRETS["ops"], log2_n=8)}"
admin = true
produce = ["tools.*"]
consume = ["tools.*"]
[apps.shop]
secret_hash = "{hash_secret(SECRETS["shop"], log2_n=8)}"
produce = ["order.*"]
"""


@dataclass
class Pki:
    dir: Path
    ca: Path
    cert: Path
    key: Path
    client_cert: Path
    client_key: Path

    def client_context(self, with_certificate: bool = False) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        if with_certificate:
            ctx.load_cert_chain(str(self.client_cert), str(self.client_key))
        return ctx


def make_pki(where: Path) -> Pki:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    client = ca.issue_cert("ops-client")
    p = Pki(where, where / "ca.pem", where / "cert.pem", where / "key.pem", where / "client.pem", where / "client.key")
    ca.cert_pem.write_to_path(str(p.ca))
    p.cert.write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(p.key))
    p.client_cert.write_bytes(b"".join(b.bytes() for b in client.cert_chain_pems))
    client.private_key_pem.write_to_path(str(p.client_key))
    (where / "auth.toml").write_text(AUTH)
    return p


def server_args(pki: Pki, client_certificates: bool = False) -> list[str]:
    args = ["--auth-file", str(pki.dir / "auth.toml"), "--app-code", "qmq-cluster"]
    args += ["--tls-cert", str(pki.cert), "--tls-key", str(pki.key)]
    return args + (["--tls-ca", str(pki.ca)] if client_certificates else [])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("tools-pki"))


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory, pki: Pki) -> Iterator[ReadyProcess]:
    """A standalone (meta server, broker, delay server, gateway) with an auth file and TLS."""
    env = {"SSL_CERT_FILE": str(pki.ca), "QMQ_SECRET": SECRETS["qmq-cluster"]}
    with running_standalone(tmp_path_factory.mktemp("tools") / "data", extra_args=server_args(pki), env=env) as proc:
        assert proc.meta_server.startswith("https://")
        yield proc


def run_qmq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The `qmq` command with a clean environment: no identity or trust but what ``env`` gives."""
    clean = {k: v for k, v in os.environ.items() if k not in ("QMQ_SECRET", "QMQ_APP_CODE", "QMQ_TLS_CA")}
    clean.pop("SSL_CERT_FILE", None)
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**clean, "COLUMNS": "250", **(env or {})},
    )


async def test_listing_commands_open_their_broker_connections_with_the_app_and_tls(
    secured: ReadyProcess, pki: Pki
) -> None:
    url = secured.meta_server
    env = {"QMQ_APP_CODE": "ops", "QMQ_SECRET": SECRETS["ops"], "QMQ_TLS_CA": str(pki.ca)}
    # qmq send and qmq consume: the SDK under the command
    for body in ("a", "b", "c"):
        done = run_qmq("send", "tools.listed", "--body", body, "--meta-server", url, env=env)
        assert done.returncode == 0, done.stderr
    done = run_qmq("consume", "tools.listed", "--group", "g", "--from", "earliest", "--count", "3", "--json",
                   "--meta-server", url, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert len(done.stdout.splitlines()) == 3

    # options before the sub-command
    done = run_qmq("--app-code", "ops", "--secret", SECRETS["ops"], "--tls-ca", str(pki.ca), "subjects", "--json",
               "--meta-server", url)  # fmt: skip
    assert done.returncode == 0, done.stderr
    [line] = [json.loads(x) for x in done.stdout.splitlines() if '"tools.listed"' in x]
    assert line["messages"] == 3

    # the environment
    done = run_qmq("lag", "tools.listed", "--group", "g", "--json", "--meta-server", url, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["broker_groups"]["broker-1"]["messages"] == 3
    done = run_qmq("delay-stats", "--json", "--meta-server", url, env=env)
    assert done.returncode == 0, done.stderr

    # qmq push add --from latest fixes the group's start on every broker group, then stores it
    done = run_qmq("push", "add", "tools.listed", "--group", "hooked", "--url", "http://127.0.0.1:9/hook",
                   "--from", "latest", "--meta-server", url, env=env)  # fmt: skip
    assert done.returncode == 0, done.stderr
    done = run_qmq("push", "remove", "tools.listed", "--group", "hooked", "--meta-server", url, env=env)
    assert done.returncode == 0, done.stderr

    # without the CA the command does not trust the servers; without the secret it is refused
    done = run_qmq("--app-code", "ops", "--secret", SECRETS["ops"], "subjects", "--meta-server", url)
    assert done.returncode != 0
    assert "certificate" in done.stderr.lower(), done.stderr
    done = run_qmq("--tls-ca", str(pki.ca), "subjects", "--meta-server", url)
    assert done.returncode != 0
    assert SECRETS["ops"] not in done.stderr


def test_the_watchdog_resends_as_the_app_it_is_given(secured: ReadyProcess, pki: Pki, tmp_path: Path) -> None:
    db_url = f"sqlite:///{tmp_path}/app.db"
    assert run_qmq("tx", "init", "--db", db_url).returncode == 0
    engine = sa.create_engine(db_url)
    try:
        msg = Message("tools.outbox", body="left behind")
        with engine.begin() as conn:
            conn.execute(
                outbox_table(DEFAULT_OUTBOX_TABLE).insert(),
                [row_values(msg.message_id, msg.subject, msg.encode(), int(time.time() * 1000) - 120_000)],
            )
        env = {"QMQ_SECRET": SECRETS["ops"]}
        argv = ["--app-code", "ops", "--tls-ca", str(pki.ca), "watchdog", "--db", db_url, "--once"]
        done = run_qmq(*argv, "--meta-server", secured.meta_server, env=env)
        assert done.returncode == 0, done.stderr
        assert "leased: resent 1, failed 0, blocked 0" in done.stdout, done.stdout + done.stderr
        with engine.connect() as conn:
            count = sa.select(sa.func.count()).select_from(outbox_table(DEFAULT_OUTBOX_TABLE))
            assert conn.execute(count).scalar() == 0
    finally:
        engine.dispose()


def _post_json(url: str, body: object, pki: Pki, app: str) -> dict[str, object]:
    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"Content-Type": "application/json", "Authorization": basic_authorization(app, SECRETS[app])},
    )
    with urllib.request.urlopen(request, timeout=30, context=pki.client_context(with_certificate=True)) as resp:
        doc: dict[str, object] = json.load(resp)
    return doc


@asynccontextmanager
async def running_receiver() -> AsyncIterator[tuple[str, list[dict[str, Any]], asyncio.Event]]:
    """An HTTP receiver of push deliveries on 127.0.0.1: its URL, what it got, and an event set at each."""
    got: list[dict[str, Any]] = []
    arrived = asyncio.Event()

    async def handle(request: web.Request) -> web.Response:
        got.append(json.loads(await request.read()))
        arrived.set()
        return web.Response(text="ok")

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook", got, arrived
    finally:
        await runner.cleanup()


async def test_push_delivers_when_every_port_requires_a_client_certificate(tmp_path: Path) -> None:
    pki = make_pki(tmp_path)
    env = {"SSL_CERT_FILE": str(pki.ca), "QMQ_SECRET": SECRETS["qmq-cluster"]}
    args = server_args(pki, client_certificates=True)
    with running_standalone(tmp_path / "data", extra_args=args, env=env) as proc:
        url = proc.meta_server
        base = url.removesuffix("/meta/address")
        async with running_receiver() as (hook, got, arrived):
            sub = {"subject": "tools.pushed", "group": "hook", "url": hook, "start_from": "earliest"}
            _post_json(f"{base}/meta/push", sub, pki, "ops")
            ctx = pki.client_context(with_certificate=True)
            async with qmq.aio.Producer(app_code="ops", meta_server=url, secret=SECRETS["ops"], ssl=ctx) as p:
                for i in range(3):
                    m = p.generate_message("tools.pushed")
                    m.body = f"push {i}".encode()
                    await p.send(m)
            deadline = time.monotonic() + 60
            while len({d["message_id"] for d in got}) < 3:
                left = deadline - time.monotonic()
                assert left > 0, f"pushed {len(got)} of 3"
                arrived.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(arrived.wait(), left)
