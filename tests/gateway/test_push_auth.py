"""HTTP push on a cluster with an auth file: `qmq push add`/`remove` need an admin app, the leases
(which carry the subscriptions' secrets) only the cluster's own servers, and a gateway running
as the cluster's app delivers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pushhelpers import running_receiver

from qmq.aio import Producer
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.testing import ReadyProcess, running_gateway, running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SECRETS = {"qmq-cluster": "cluster-secret", "shop": "shop-secret", "ops": "ops-secret"}


def _auth_text() -> str:
    h = {app: hash_secret(secret, log2_n=8) for app, secret in SECRETS.items()}
    return f"""
[apps.qmq-cluster]
secret_hash = "{h["qmq-cluster"]}"
cluster = true
[apps.shop]
secret_hash = "{h["shop"]}"
produce = ["order.*"]
consume = ["order.*"]
[apps.ops]
secret_hash = "{h["ops"]}"
admin = true
"""


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReadyProcess, ReadyProcess]]:
    """A meta server and a broker with an auth file, and a gateway running as the cluster's app."""
    tmp = tmp_path_factory.mktemp("push-auth")
    auth_file = tmp / "auth.toml"
    auth_file.write_text(_auth_text())
    env = {"QMQ_SECRET": SECRETS["qmq-cluster"]}
    with running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0", "--auth-file", str(auth_file)]) as meta:
        broker_args = ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", meta.meta_server]
        broker_args += ["--auth-file", str(auth_file), "--app-code", "qmq-cluster"]
        with (
            running_role(broker_args, env=env),
            running_gateway(meta.meta_server, env, "--app-code", "qmq-cluster") as gateway,
        ):
            yield meta, gateway


def _push(meta_server: str, *args: str, app: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QMQ_SECRET", "QMQ_APP_CODE")}
    if app is not None:
        env.update(QMQ_APP_CODE=app, QMQ_SECRET=SECRETS[app])
    return subprocess.run(
        [sys.executable, "-m", "qmq", "push", *args, "--meta-server", meta_server],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env=env,
    )


def _post(url: str, body: object, app: str | None) -> int:
    headers = {"Content-Type": "application/json"}
    if app is not None:
        headers["Authorization"] = basic_authorization(app, SECRETS[app])
    request = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return int(answer.status)
    except urllib.error.HTTPError as exc:
        return int(exc.code)


async def test_push_with_an_auth_file(secured: tuple[ReadyProcess, ReadyProcess], tmp_path: Path) -> None:
    meta, _gateway = secured
    subject, group = f"order.{uuid.uuid4().hex[:8]}", "billing"
    async with running_receiver() as rx:
        add = ("add", subject, "--group", group, "--url", rx.url, "--secret", "hook-secret")
        refused = _push(meta.meta_server, *add, app=None)
        assert refused.returncode == 1
        assert "needs an app code and secret" in refused.stderr
        forbidden = _push(meta.meta_server, *add, app="shop")
        assert forbidden.returncode == 1
        assert "app 'shop' may not admin" in forbidden.stderr
        added = _push(meta.meta_server, *add, app="ops")
        assert added.returncode == 0, added.stderr

        lease: dict[str, Any] = {"owner": "intruder", "lease_ms": 5_000}
        base = meta.ready["http"]
        assert _post(base + "/meta/push/lease", lease, None) == 401
        assert _post(base + "/meta/push/lease", lease, "shop") == 403
        assert _post(base + "/meta/push/lease", lease, "ops") == 403  # an admin is not a server of the cluster

        listed = _push(meta.meta_server, "list", "--json", app="shop")
        assert listed.returncode == 0, listed.stderr
        (sub,) = json.loads(listed.stdout)["subscriptions"]
        assert sub["secret"] == "***"

        async with Producer(app_code="shop", meta_server=meta.meta_server, secret=SECRETS["shop"]) as producer:
            m = producer.generate_message(subject)
            m.body = "paid"
            await producer.send(m)
        await rx.wait_until("the delivery", lambda: len(rx.ok()) == 1)
        assert rx.ok()[0].message_id == m.message_id
        removed = _push(meta.meta_server, "remove", subject, "--group", group, app="ops")
        assert removed.returncode == 0, removed.stderr
