"""Limits edited live (`qmq limits set|remove`, `/meta/limits`): a broker applies a new limit, a
raised one and a removed one within a second, without a restart (real processes)."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from tests.auth.test_quotas import HASH, SECRET, qmq_cli
from tests.auth_files import write_auth_file

import qmq.aio
from qmq.testing import running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

_APPLIED_S = 1.0  # the promise: a change holds on every broker within a second


async def _throttled(p: qmq.aio.Producer, subject: str, n: int) -> int:
    """THROTTLED answers the producer got (and retried) while storing ``n`` messages in three
    rounds, one after another (a frame under the quota passes whole, leaving the bucket in debt)."""
    before = p.stats.retries
    for _ in range(3):
        await asyncio.gather(*(p.send_nowait(p.generate_message(subject)) for _ in range(n // 3)))
    return p.stats.retries - before


async def test_a_limit_changed_live_holds_within_a_second(tmp_path: Path) -> None:
    secrets = {"qmq-cluster": "c-secret", "ops": "o-secret"}
    auth = write_auth_file(
        tmp_path / "auth.toml",
        secrets["qmq-cluster"],
        secrets["ops"],
        f'[apps.shop]\nsecret_hash = "{HASH}"\nproduce = ["*"]',
    )
    common = ["--auth-file", str(auth)]
    env = {"QMQ_SECRET": secrets["qmq-cluster"]}
    ops = {"app": "ops", "secret": secrets["ops"]}
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0", *common], env=env) as meta:
        args = ["broker", "--data-dir", str(tmp_path / "b"), "--meta-server", meta.meta_server, *common]
        with running_role([*args, "--app-code", "qmq-cluster"], env=env):
            url = meta.meta_server
            async with qmq.aio.Producer(app_code="shop", meta_server=url, secret=SECRET, send_timeout_ms=60_000) as p:
                assert await _throttled(p, "live.x", 300) == 0  # no limit yet
                low = ["limits", "set", "shop", "live.*", "--produce-msgs-per-s", "100", "--meta-server", url]
                done = qmq_cli(*low, **ops)
                assert done.returncode == 0, done.stderr
                assert "within a second" in done.stdout
                await asyncio.sleep(_APPLIED_S)
                started = time.monotonic()
                assert await _throttled(p, "live.x", 300) > 0, "the limit set live was not applied within a second"
                assert time.monotonic() - started > 1.0  # 300 at 100/s: about 3 s
                high = ["limits", "set", "shop", "live.*", "--produce-msgs-per-s", "100000", "--meta-server", url]
                assert qmq_cli(*high, **ops).returncode == 0
                await asyncio.sleep(_APPLIED_S)
                assert await _throttled(p, "live.x", 300) == 0, "the raised limit was not applied within a second"
                assert qmq_cli(*low, **ops).returncode == 0
                await asyncio.sleep(_APPLIED_S)
                assert await _throttled(p, "live.x", 300) > 0
                removed = qmq_cli("limits", "remove", "shop", "live.*", "--meta-server", url, **ops)
                assert removed.returncode == 0, removed.stderr
                await asyncio.sleep(_APPLIED_S)
                assert await _throttled(p, "live.x", 300) == 0, "the removed limit still held after a second"
