"""The meta server with an auth file, and a whole cluster with one: only the cluster's own
servers register (the attack of issue 21 — an unauthenticated POST /meta/register of a made-up
group "evil" — is refused), clients send an Authorization header, SIGHUP reloads the file, and
without an auth file a role listens on loopback only unless told --insecure."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import qmq
import qmq.aio
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import hash_secret
from qmq.testing import ReadyProcess, running_role
from qmq.testing.processes import qmq_argv

pytestmark = pytest.mark.integration

SECRETS = {"qmq-cluster": "cluster-secret", "shop": "shop-secret", "ops": "ops-secret", "late": "late-secret"}
HASHES = {app: hash_secret(secret, log2_n=8) for app, secret in SECRETS.items()}
EVIL = {"role": "broker", "group": "evil", "address": "127.0.0.1:9", "http": "127.0.0.1:9", "pid": 1}


def auth_text(with_late: bool = False) -> str:
    text = f"""
[apps.qmq-cluster]
secret_hash = "{HASHES["qmq-cluster"]}"
cluster = true
[apps.shop]
secret_hash = "{HASHES["shop"]}"
produce = ["order.*"]
consume = ["order.*"]
[apps.ops]
secret_hash = "{HASHES["ops"]}"
admin = true
"""
    if with_late:
        text += f'[apps.late]\nsecret_hash = "{HASHES["late"]}"\n'
    return text


def http(method: str, url: str, app: str | None = None, body: object = None) -> tuple[int, dict[str, Any]]:
    headers = {"Content-Type": "application/json"}
    if app is not None:
        headers["Authorization"] = basic_authorization(app, SECRETS[app])
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReadyProcess, ReadyProcess, Path]]:
    tmp = tmp_path_factory.mktemp("meta-auth")
    auth_file = tmp / "auth.toml"
    auth_file.write_text(auth_text())
    env = {"QMQ_SECRET": SECRETS["qmq-cluster"]}
    with running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0", "--auth-file", str(auth_file)]) as meta:
        broker_args = ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", meta.meta_server]
        broker_args += ["--auth-file", str(auth_file), "--app-code", "qmq-cluster"]
        with running_role(broker_args, env=env) as broker:
            yield meta, broker, auth_file


def base(meta: ReadyProcess) -> str:
    return meta.ready["http"]


def test_an_unauthenticated_registration_of_a_made_up_group_is_refused(
    secured: tuple[ReadyProcess, ReadyProcess, Path],
) -> None:
    meta = secured[0]
    status, body = http("POST", base(meta) + "/meta/register", None, EVIL)
    assert status == 401
    assert "Authorization" in body["error"]
    status, body = http("POST", base(meta) + "/meta/register", "shop", EVIL)  # a known app, not the cluster's
    assert status == 403
    assert body == {
        "error": "app 'shop' may not cluster (POST /meta/register); ask for it in the auth file's [apps.shop] "
        "(docs/security.md)",
        "app": "shop",
        "action": "cluster",
    }
    status, doc = http("GET", meta.meta_server, "shop")
    assert status == 200
    assert [g["group"] for g in doc["broker_groups"]] == ["broker-1"]  # no "evil"


def test_reading_needs_a_known_app_and_promotion_an_admin(secured: tuple[ReadyProcess, ReadyProcess, Path]) -> None:
    meta = secured[0]
    assert http("GET", meta.meta_server)[0] == 401
    assert http("GET", base(meta) + "/meta/cluster", "shop")[0] == 200
    assert http("POST", base(meta) + "/meta/promote", "shop", {"group": "broker-1", "role": "broker"})[0] == 403
    status, _ = http("POST", base(meta) + "/meta/promote", "ops", {"group": "broker-1", "role": "broker"})
    assert status not in (401, 403)  # allowed: what the registry says of it is another matter
    with urllib.request.urlopen(base(meta) + "/health", timeout=10) as resp:
        assert resp.status == 200


async def test_a_cluster_with_auth_end_to_end(secured: tuple[ReadyProcess, ReadyProcess, Path]) -> None:
    meta = secured[0]
    async with qmq.aio.Producer(app_code="shop", meta_server=meta.meta_server, secret=SECRETS["shop"]) as p:
        msg = p.generate_message("order.paid")
        msg.body = b"42"
        await p.send(msg)
    async with qmq.aio.Consumer(app_code="shop", meta_server=meta.meta_server, secret=SECRETS["shop"]) as c:
        batch = await c.pull_consumer("order.paid", "billing", start_from="earliest").pull(10, 5000)
        assert [m.body for m in batch] == [b"42"]


async def test_a_client_with_a_wrong_secret_is_refused_at_start(
    secured: tuple[ReadyProcess, ReadyProcess, Path],
) -> None:
    producer = qmq.aio.Producer(app_code="shop", meta_server=secured[0].meta_server, secret="wrong")
    with pytest.raises(qmq.AuthError, match="app 'shop' could not authenticate") as info:
        await producer.start()
    assert info.value.app_code == "shop"


def test_sighup_reloads_the_meta_servers_auth_file(secured: tuple[ReadyProcess, ReadyProcess, Path]) -> None:
    meta, _broker, auth_file = secured
    assert http("GET", meta.meta_server, "late")[0] == 401
    auth_file.write_text(auth_text(with_late=True))
    try:
        meta.proc.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 20
        while http("GET", meta.meta_server, "late")[0] != 200:  # the reload is asynchronous: poll, bounded
            assert time.monotonic() < deadline, "the meta server did not reload its auth file on SIGHUP"
            time.sleep(0.05)
    finally:
        auth_file.write_text(auth_text())
        meta.proc.send_signal(signal.SIGHUP)


@pytest.mark.parametrize("role", ["meta", "broker"])
def test_without_an_auth_file_only_loopback_unless_insecure(tmp_path: Path, role: str) -> None:
    args = [role, "--data-dir", str(tmp_path / role), "--host", "0.0.0.0", "--port", "0"]
    if role == "broker":
        args += ["--http-port", "0"]
    refused = subprocess.run(qmq_argv(*args), capture_output=True, text=True, timeout=60, check=False)
    assert refused.returncode == 3
    assert "without authentication" in refused.stderr
    assert "--auth-file" in refused.stderr
    assert "--insecure" in refused.stderr
    proc = subprocess.Popen(
        qmq_argv(*args, "--insecure"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        env={**os.environ, "QMQ_LOG_LEVEL": "WARNING"},
    )
    try:
        assert proc.stderr is not None
        said = [proc.stderr.readline().decode() for _ in range(2)]  # the log line, then the line printed
        assert any(f"qmq {role}: " in line and "WITHOUT authentication (--insecure)" in line for line in said)
    finally:
        proc.terminate()
        proc.communicate(timeout=30)


def qmq_cli(*args: str, app: str | None = None, secret: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in ("QMQ_APP_CODE", "QMQ_SECRET")}
    if app is not None:
        env["QMQ_APP_CODE"] = app
    if secret is not None:
        env["QMQ_SECRET"] = secret
    return subprocess.run(qmq_argv(*args), capture_output=True, text=True, timeout=60, check=False, env=env)


def test_the_cli_acts_as_an_app(secured: tuple[ReadyProcess, ReadyProcess, Path]) -> None:
    url = secured[0].meta_server
    sent = qmq_cli("send", "order.cli", "--body", "x", "--meta-server", url, app="shop", secret=SECRETS["shop"])
    assert sent.returncode == 0, sent.stderr
    anonymous = qmq_cli("send", "order.cli", "--body", "x", "--meta-server", url)
    assert anonymous.returncode == 1
    assert "Authorization" in anonymous.stderr
    assert "Traceback" not in anonymous.stderr
    # the options of `qmq` itself do the same as the environment
    reset = ["--app-code", "shop", "--secret", SECRETS["shop"], "reset-offset", "order.cli"]
    refused = qmq_cli(*reset, "--group", "g", "--to", "earliest", "--meta-server", url)
    assert refused.returncode == 1
    assert "app 'shop' may not admin" in refused.stderr
    allowed = qmq_cli("reset-offset", "order.cli", "--group", "g", "--to", "earliest", "--meta-server", url,
                      app="ops", secret=SECRETS["ops"])  # fmt: skip
    assert allowed.returncode == 0, allowed.stderr
