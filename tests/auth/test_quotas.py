"""Quotas: the auth file's per-app rates, the token buckets, and a broker holding a producer and
a consumer group to them within 10% over 10 s (real processes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

import qmq
import qmq.aio
from qmq.auth.file import parse_auth
from qmq.auth.quotas import BURST_S, Buckets, Quota, quota_for
from qmq.auth.secrets import hash_secret
from qmq.common.errors import ConfigError
from qmq.testing import running_role

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
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
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
            yield meta.meta_server


def _within_10_percent(count: int, rate: int, seconds: float) -> None:
    expected = rate * seconds
    assert abs(count - expected) <= 0.1 * expected, f"{count} in {seconds:.1f} s; the quota allows {expected:.0f}"


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.timeout(120)
async def test_a_producer_is_held_to_its_quota(broker: str) -> None:
    stored = 0
    async with qmq.aio.Producer(app_code="shop", meta_server=broker, secret=SECRET, send_timeout_ms=30_000) as p:
        window = asyncio.Semaphore(500)

        def done(fut: asyncio.Future[None]) -> None:
            nonlocal stored
            window.release()
            if not fut.cancelled() and fut.exception() is None:
                stored += 1

        started = time.monotonic()
        while time.monotonic() - started < 10.0:
            await window.acquire()
            p.send_nowait(p.generate_message("limited.orders")).add_done_callback(done)
        counted_at = time.monotonic()
        counted = stored
        # and nothing is refused: the throttled sends are stored later
        for _ in range(500):
            await window.acquire()
    assert stored >= counted
    _within_10_percent(counted, PRODUCE_RATE, counted_at - started)


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
