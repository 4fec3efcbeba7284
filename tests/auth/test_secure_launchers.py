"""`qmq standalone` and `qmq cluster up` with an auth file and TLS: every role gets them, the
servers authenticate to each other as the cluster's app (registration, a slave's replication,
the delay server's hand-over), and clients get in with their own app over TLS."""

from __future__ import annotations

import json
import os
import ssl
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import trustme

import qmq.aio
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.cli.cluster_launch import Cluster, is_running, stop
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow]

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


@dataclass
class Files:
    auth: Path
    cert: Path
    key: Path
    ca: Path
    ctx: ssl.SSLContext

    def args(self) -> list[str]:
        return ["--auth-file", str(self.auth), "--tls-cert", str(self.cert), "--tls-key", str(self.key)]

    def env(self) -> dict[str, str]:
        return {"SSL_CERT_FILE": str(self.ca), "QMQ_SECRET": SECRETS["qmq-cluster"]}


@pytest.fixture
def files(tmp_path: Path) -> Files:
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1")
    f = Files(
        tmp_path / "auth.toml",
        tmp_path / "c.pem",
        tmp_path / "k.pem",
        tmp_path / "ca.pem",
        ssl.create_default_context(),
    )
    f.auth.write_text(AUTH)
    f.cert.write_bytes(b"".join(b.bytes() for b in server.cert_chain_pems))
    server.private_key_pem.write_to_path(str(f.key))
    ca.cert_pem.write_to_path(str(f.ca))
    ca.configure_trust(f.ctx)
    return f


async def test_standalone_with_auth_and_tls_hands_delay_messages_over(tmp_path: Path, files: Files) -> None:
    args = [*files.args(), "--app-code", "qmq-cluster"]
    with running_standalone(tmp_path / "data", extra_args=args, env=files.env()) as proc:
        url = proc.meta_server
        assert url.startswith("https://")
        assert proc.gateway.startswith("https://")
        async with qmq.aio.Producer(app_code="shop", meta_server=url, secret=SECRETS["shop"], ssl=files.ctx) as p:
            msg = p.generate_message("order.later")
            msg.body = b"due soon"
            msg.set_delay(0.5)  # stored by the delay server, handed to the broker when due
            await p.send(msg)
        async with qmq.aio.Consumer(app_code="shop", meta_server=url, secret=SECRETS["shop"], ssl=files.ctx) as c:
            pull = c.pull_consumer("order.later", "g", start_from="earliest")
            deadline = time.monotonic() + 30
            got: list[bytes] = []
            while not got:
                assert time.monotonic() < deadline, "the delay message never reached the broker"
                got = [m.body for m in await pull.pull(10, 1000)]
        assert got == [b"due soon"]


def view(base: str, files: Files) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{base}/meta/cluster", headers={"Authorization": basic_authorization("shop", SECRETS["shop"])}
    )
    with urllib.request.urlopen(request, timeout=10, context=files.ctx) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


@pytest.fixture
def cluster_dir(tmp_path: Path) -> Iterator[Path]:
    data_dir = tmp_path / "cluster"
    yield data_dir
    if (data_dir / "cluster.json").exists():
        members = Cluster.load(data_dir).members
        subprocess.run([sys.executable, "-m", "qmq", "cluster", "down", "--data-dir", str(data_dir)], timeout=60)
        stop([m for m in members if is_running(m)], timeout_s=5.0)


def test_cluster_up_with_auth_and_tls_replicates(cluster_dir: Path, files: Files) -> None:
    argv = [sys.executable, "-m", "qmq", "cluster", "up", "--data-dir", str(cluster_dir)]
    argv += ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0", *files.args(), "--app-code", "qmq-cluster"]
    env = {**os.environ, **files.env(), "QMQ_LOG_LEVEL": "WARNING"}
    done = subprocess.run(argv, capture_output=True, text=True, timeout=180, env=env, stdin=subprocess.DEVNULL)
    assert done.returncode == 0, done.stderr
    [line] = [x for x in done.stdout.splitlines() if x.startswith("qmq ready")]
    meta_server = dict(p.split("=", 1) for p in line.split()[2:])["meta_server"]
    assert meta_server.startswith("https://")
    base = meta_server.removesuffix("/meta/address")
    deadline = time.monotonic() + 60
    while True:  # the slave registers, then replicates from its master over TLS as the cluster's app
        slaves = [s for s in view(base, files)["servers"] if s["role_in_group"] == "slave"]
        if slaves and slaves[0]["replicated_ms"] > 0:
            break
        assert time.monotonic() < deadline, f"the slave did not replicate: {slaves}"
        time.sleep(0.1)  # polling the meta server's view, bounded by the deadline
