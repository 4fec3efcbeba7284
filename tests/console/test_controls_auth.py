"""Pause and resume with an auth file (real processes): only an admin app may pause, and a broker
that authenticates to the meta server applies the pause and the resume."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tests.auth.test_quotas import qmq_cli
from tests.auth_files import write_auth_file

from qmq.auth.secrets import hash_secret
from qmq.testing import running_role

pytestmark = pytest.mark.integration

SECRETS = {"qmq-cluster": "c-secret", "ops": "o-secret", "shop": "s-secret"}


def test_an_admin_pauses_and_an_authenticated_broker_applies_it(tmp_path: Path) -> None:
    shop = f'[apps.shop]\nsecret_hash = "{hash_secret(SECRETS["shop"], log2_n=8)}"\nproduce = ["*"]\nconsume = ["*"]'
    auth = write_auth_file(tmp_path / "auth.toml", SECRETS["qmq-cluster"], SECRETS["ops"], shop)
    common = ["--auth-file", str(auth)]
    env = {"QMQ_SECRET": SECRETS["qmq-cluster"]}
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0", *common], env=env) as meta:
        args = ["broker", "--data-dir", str(tmp_path / "b"), "--meta-server", meta.meta_server, *common]
        with running_role([*args, "--app-code", "qmq-cluster"], env=env):
            url = ["--meta-server", meta.meta_server]

            def as_app(app: str, *argv: str) -> list[str]:
                out = qmq_cli(*argv, *url, app=app, secret=SECRETS[app])
                assert out.returncode == 0, out.stderr
                return [json.loads(line)["body"] for line in out.stdout.splitlines() if line.startswith("{")]

            as_app("shop", "send", "s.x", "--body", "a")
            assert as_app("shop", "consume", "s.x", "--group", "g", "--from", "earliest", "--count", "1", "--json") == [
                "a"
            ]
            refused = qmq_cli("group", "pause", "s.x", "--group", "g", *url, app="shop", secret=SECRETS["shop"])
            assert refused.returncode == 1
            assert "HTTP 403" in refused.stderr
            as_app("ops", "group", "pause", "s.x", "--group", "g")
            time.sleep(1.0)  # the promise under test: applied within a second
            as_app("shop", "send", "s.x", "--body", "b")
            assert as_app("shop", "consume", "s.x", "--group", "g", "--idle-exit-ms", "1500", "--json") == []
            as_app("ops", "group", "resume", "s.x", "--group", "g")
            time.sleep(1.0)
            assert as_app("shop", "consume", "s.x", "--group", "g", "--count", "1", "--json") == ["b"]

            # a transform is a change (an admin's); a group's consumers a read, which the meta server
            # makes of the brokers with the caller's own credentials
            refused = qmq_cli(
                "group", "transform", "s.x", "--group", "g", "--expr", "body", *url, app="shop", secret=SECRETS["shop"]
            )
            assert refused.returncode == 1
            assert "HTTP 403" in refused.stderr
            as_app("ops", "group", "transform", "s.x", "--group", "g", "--expr", "body")
            ask = ["group", "consumers", "s.x", "--group", "g", "--json", *url]
            seen = qmq_cli(*ask, app="shop", secret=SECRETS["shop"])
            assert seen.returncode == 0, seen.stderr
            doc = json.loads(seen.stdout)
            # three `qmq consume` runs: three consumers
            assert (doc["group"], doc["unreachable"], doc["consumers_total"], len(doc["consumers"])) == ("g", [], 3, 3)
            # the delete check asks the brokers as the admin: refused while a message waits
            as_app("ops", "subject", "create", "s.x", "--owner", "team")
            as_app("shop", "send", "s.x", "--body", "c")
            left = qmq_cli("subject", "delete", "s.x", *url, app="ops", secret=SECRETS["ops"])
            assert left.returncode == 1
            assert "group 'g': 1 not pulled" in left.stderr, left.stderr
