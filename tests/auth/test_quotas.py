"""Quotas: the auth file's per-app rates, the token buckets, and a broker holding a producer and
a consumer group to them within 10% over 10 s (real processes)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests.auth_files import write_auth_file

import qmq
import qmq.aio
from qmq.auth.file import parse_auth
from qmq.auth.quotas import BURST_S, Buckets, Quota, quota_for
from qmq.auth.secrets import hash_secret
from qmq.common.errors import ConfigError
from qmq.store.reader import StoreReader
from qmq.testing import running_role
from qmq.testing.processes import qmq_argv

SECRET = "quota-secret"
HASH = hash_secret(SECRET, log2_n=8)
PRODUCE_RATE = 300
CONSUME_RATE = 200


def test_quotas_are_read_from_the_auth_file() -> None:
    auth = parse_auth(
        {
            "apps": {
                "shop": {
                    "secret_hash": HASH,
                    "quotas": {
                        "order.*": {"produce_msgs_per_s": 100, "produce_bytes_per_s": 1000},
                        "order.*:billing": {"consume_msgs_per_s": 50},
                    },
                }
            }
        },
        "test",
    )
    rules = auth.apps["shop"].quotas
    assert quota_for(rules, "order.paid") == Quota(produce_msgs_per_s=100, produce_bytes_per_s=1000)
    assert quota_for(rules, "order.paid", "billing") == Quota(produce_msgs_per_s=100, produce_bytes_per_s=1000)
    assert quota_for(rules, "order.paid", "shipping") == Quota(produce_msgs_per_s=100, produce_bytes_per_s=1000)
    assert quota_for(rules[1:], "order.paid", "billing") == Quota(consume_msgs_per_s=50)
    assert quota_for(rules, "payment.x") is None


@pytest.mark.parametrize(
    ("quotas", "says"),
    [
        ({"a": {"produce_msgs_per_s": -1}}, "must be a number"),
        ({"a": {"produce_per_s": 1}}, "unknown key"),
        ({"a": 5}, "must be a table"),
    ],
)
def test_a_bad_quota_is_named(quotas: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says):
        parse_auth({"apps": {"shop": {"secret_hash": HASH, "quotas": quotas}}}, "test")


def test_a_bucket_holds_its_rate_on_average() -> None:
    buckets = Buckets()
    key = ("produce", "msgs", "shop", "s")
    admitted = 0
    now = 0.0
    while now < 10.0:  # a client sending batches of 7 as soon as it may
        wait = buckets.wait_s(key, 100.0, now)
        if wait > 0:
            now += wait
            continue
        buckets.take(key, 100.0, 7, now)
        admitted += 7
    assert abs(admitted - 1000) <= 100 * BURST_S + 7
    assert len(buckets) == 1


def test_the_buckets_are_bounded() -> None:
    buckets = Buckets(buckets_max=3)
    for i in range(10):
        buckets.take(("k", str(i)), 1.0, 1, 0.0)
    assert len(buckets) == 3


@pytest.fixture(scope="module")
def quota_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A broker with quotas: the meta server's URL and the broker's data directory."""
    tmp = tmp_path_factory.mktemp("quotas")
    auth = tmp / "auth.toml"
    auth.write_text(
        f"""
[apps.shop]
secret_hash = "{HASH}"
produce = ["*"]
consume = ["*"]
[apps.shop.quotas]
"limited.*" = {{ produce_msgs_per_s = {PRODUCE_RATE} }}
"drained.*:slow" = {{ consume_msgs_per_s = {CONSUME_RATE} }}
"""
    )
    with running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0"]) as meta:
        args = ["broker", "--data-dir", str(tmp / "broker"), "--meta-server", meta.meta_server]
        with running_role([*args, "--auth-file", str(auth)]):
            yield meta.meta_server, tmp / "broker"


@pytest.fixture
def broker(quota_broker: tuple[str, Path]) -> str:
    return quota_broker[0]


def _within_10_percent(count: int, rate: int, seconds: float) -> None:
    expected = rate * seconds
    assert abs(count - expected) <= 0.1 * expected, f"{count} in {seconds:.1f} s; the quota allows {expected:.0f}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_producer_is_held_to_its_quota(quota_broker: tuple[str, Path]) -> None:
    meta_server, broker_dir = quota_broker
    async with qmq.aio.Producer(app_code="shop", meta_server=meta_server, secret=SECRET, send_timeout_ms=30_000) as p:
        window = asyncio.Semaphore(500)
        failed: list[BaseException] = []

        def done(fut: asyncio.Future[None]) -> None:
            window.release()
            if not fut.cancelled() and fut.exception() is not None:
                failed.append(fut.exception())  # type: ignore[arg-type]

        started_ms = time.time() * 1000
        while time.time() * 1000 - started_ms < 10_000:
            await window.acquire()
            p.send_nowait(p.generate_message("limited.orders")).add_done_callback(done)
        # and nothing is refused: the throttled sends are stored later
        for _ in range(500):
            await window.acquire()
    assert not failed
    # Counted by the broker's own store times, past the burst the bucket starts with: what a loaded
    # client machine acknowledged late does not count against the window.
    reader = StoreReader(broker_dir)
    low_ms, high_ms = int(started_ms + (BURST_S + 1) * 1000), int(started_ms + 9_500)
    stored = reader.seq_at_time("limited.orders", high_ms) - reader.seq_at_time("limited.orders", low_ms)
    _within_10_percent(stored, PRODUCE_RATE, (high_ms - low_ms) / 1000)


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_pulls_over_the_consume_quota_are_slowed_not_refused(broker: str) -> None:
    async with qmq.aio.Producer(app_code="shop", meta_server=broker, secret=SECRET) as p:
        await asyncio.gather(*(p.send_nowait(p.generate_message("drained.orders")) for _ in range(4000)))
    async with qmq.aio.Consumer(app_code="shop", meta_server=broker, secret=SECRET) as c:
        pull = c.pull_consumer("drained.orders", "slow", start_from="earliest")
        got = 0
        started = time.monotonic()
        while time.monotonic() - started < 10.0:
            batch = await pull.pull(max_messages=1000, timeout_ms=1000)  # never refused, only held back
            batch.ack_all()
            got += len(batch)
        _within_10_percent(got, CONSUME_RATE, time.monotonic() - started)
        fast = c.pull_consumer("drained.orders", "fast", start_from="earliest")  # another group: no quota
        assert len(await fast.pull(max_messages=1000, timeout_ms=1000)) > 100


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_multi_subject_pull_is_held_to_the_consume_quota_of_each_group(broker: str) -> None:
    async with qmq.aio.Producer(app_code="shop", meta_server=broker, secret=SECRET) as p:
        await asyncio.gather(*(p.send_nowait(p.generate_message("drained.many")) for _ in range(4000)))
        await asyncio.gather(*(p.send_nowait(p.generate_message("plain.many")) for _ in range(500)))
    async with qmq.aio.Consumer(app_code="shop", meta_server=broker, secret=SECRET) as c:
        slow = c.pull_consumer("drained.many", "slow", start_from="earliest")  # "drained.*:slow" has a quota
        free = c.pull_consumer("plain.many", "slow", start_from="earliest")  # none for this subject
        got, free_got = 0, 0
        started = time.monotonic()
        while time.monotonic() - started < 10.0:
            slow_batch, free_batch = await c.pull_many([slow, free], max_messages=2000, per_subject_max=1000)
            slow_batch.ack_all()
            free_batch.ack_all()
            got += len(slow_batch)
            free_got += len(free_batch)
            if not slow_batch:
                await asyncio.sleep(0.02)  # PULL_MANY does not wait: an over-quota entry gets nothing
        _within_10_percent(got, CONSUME_RATE, time.monotonic() - started)
        assert free_got == 500, "the other entry of the same requests is not held back"


RUNTIME_RATE = 200


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(180)
async def test_limits_set_at_run_time_reach_the_broker(tmp_path: Path) -> None:
    secrets = {"qmq-cluster": "c-secret", "ops": "o-secret"}
    auth = write_auth_file(
        tmp_path / "auth.toml",
        secrets["qmq-cluster"],
        secrets["ops"],
        f'[apps.shop]\nsecret_hash = "{HASH}"\nproduce = ["*"]',
    )
    common = ["--auth-file", str(auth)]
    env = {"QMQ_SECRET": secrets["qmq-cluster"]}
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0", *common], env=env) as meta:
        args = ["broker", "--data-dir", str(tmp_path / "b"), "--meta-server", meta.meta_server, *common]
        with running_role([*args, "--app-code", "qmq-cluster"], env=env):
            url = meta.meta_server
            limit = ["limits", "set", "shop", "rt.*", "--produce-msgs-per-s", str(RUNTIME_RATE), "--meta-server", url]
            refused = qmq_cli(*limit, app="shop", secret=SECRET)
            assert refused.returncode == 1
            assert "HTTP 403" in refused.stderr
            done = qmq_cli(*limit, app="ops", secret=secrets["ops"])
            assert done.returncode == 0, done.stderr
            listed = qmq_cli("limits", "list", "--json", "--meta-server", url, app="shop", secret=SECRET)
            assert listed.returncode == 0, listed.stderr
            [row] = [json.loads(line) for line in listed.stdout.splitlines()]
            assert (row["app"], row["pattern"], row["produce_msgs_per_s"]) == ("shop", "rt.*", RUNTIME_RATE)
            async with qmq.aio.Producer(app_code="shop", meta_server=url, secret=SECRET, send_timeout_ms=30_000) as p:
                deadline = time.monotonic() + 30
                while p.stats.retries == 0:  # the broker asks for the limits every 2 s: wait for the first THROTTLED
                    assert time.monotonic() < deadline, "the broker never applied the limit set at run time"
                    await asyncio.gather(*(p.send_nowait(p.generate_message("rt.x")) for _ in range(100)))
                counted, elapsed = await _send_for(p, "rt.x", 10.0)
            _within_10_percent(counted, RUNTIME_RATE, elapsed)
            removed = qmq_cli(
                "limits", "remove", "shop", "rt.*", "--meta-server", url, app="ops", secret=secrets["ops"]
            )
            assert removed.returncode == 0, removed.stderr


async def _send_for(p: qmq.aio.Producer, subject: str, seconds: float) -> tuple[int, float]:
    """Messages stored while sending as fast as a window of 500 allows for at least ``seconds``,
    and the seconds that really took (the last wait for room in the window may run past them)."""
    stored = 0
    window = asyncio.Semaphore(500)

    def done(fut: asyncio.Future[None]) -> None:
        nonlocal stored
        window.release()
        if not fut.cancelled() and fut.exception() is None:
            stored += 1

    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await window.acquire()
        p.send_nowait(p.generate_message(subject)).add_done_callback(done)
    counted, elapsed = stored, time.monotonic() - started
    for _ in range(500):  # the rest are stored later, none refused
        await window.acquire()
    return counted, elapsed


def qmq_cli(*args: str, app: str, secret: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "QMQ_APP_CODE": app, "QMQ_SECRET": secret}
    return subprocess.run(qmq_argv(*args), capture_output=True, text=True, timeout=60, check=False, env=env)
