"""The delay server's commands as a user runs them: `qmq send --delay/--at`, `qmq delay-stats`,
`qmq delay` alone (ready line, SIGTERM, startup failures), and a send without a delay server."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from delaywire import delay_group

from qmq import SendError
from qmq.aio import Producer
from qmq.testing import ReadyProcess, running_role

pytestmark = pytest.mark.integration


def qmq(*args: str, meta_server: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("QMQ_META_SERVER", None)
    if meta_server:
        env["QMQ_META_SERVER"] = meta_server
    return subprocess.run([sys.executable, "-m", "qmq", *args], capture_output=True, text=True, env=env, timeout=60)


def consume_json(subject: str, count: int, meta_server: str) -> list[dict[str, object]]:
    out = qmq(
        "consume", subject, "--group", "g", "--from", "earliest", "--count", str(count), "--json", "--idle-exit-ms",
        "8000", meta_server=meta_server,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    return [json.loads(line) for line in out.stdout.splitlines()]


def test_send_with_delay_and_at(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    before = time.time()
    delayed = qmq("send", subject, "--delay", "1s", "--body", "later", meta_server=url)
    assert delayed.returncode == 0, delayed.stderr
    at = (datetime.now(UTC) + timedelta(seconds=1)).astimezone().isoformat()
    at_sent = qmq("send", subject, "--at", at, "--body", "at", meta_server=url)
    assert at_sent.returncode == 0, at_sent.stderr
    docs = consume_json(subject, 2, url)
    assert sorted(d["body"] for d in docs) == ["at", "later"], docs
    for d in docs:
        stored = datetime.fromisoformat(str(d["stored_at"])).timestamp()
        assert stored >= before + 1.0, (d, before)  # stored by the broker only once due


def test_send_refuses_bad_delay_and_at(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    bad = qmq("send", subject, "--delay", "5x", meta_server=url)
    assert bad.returncode == 2
    assert "'5x' is not a duration" in bad.stderr
    naive = qmq("send", subject, "--at", "2026-12-24T18:00:00", meta_server=url)
    assert naive.returncode == 2
    assert "has no UTC offset" in naive.stderr
    both = qmq("send", subject, "--delay", "1m", "--at", "2026-12-24T18:00:00Z", meta_server=url)
    assert both.returncode == 2
    far = qmq("send", subject, "--delay", "800d", meta_server=url)
    assert far.returncode == 1  # the delay server refuses it: a failure, not a usage error
    assert "the horizon is 730 days (horizon_days)" in far.stderr


def test_delay_stats_shows_each_delay_group(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    assert qmq("send", subject, "--delay", "2h", meta_server=url).returncode == 0
    out = qmq("delay-stats", meta_server=url)
    assert out.returncode == 0, out.stderr
    assert "delay group delay-1" in out.stdout
    assert "dispatched in the last minute" in out.stdout
    as_json = qmq("delay-stats", "--json", meta_server=url)
    doc = json.loads(as_json.stdout)
    stats = doc["groups"]["delay-1"]
    assert stats["pending"] >= 1
    assert any(b["pending"] >= 1 for b in stats["buckets"])


@pytest.fixture(scope="module")
def lone_meta(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A meta server of its own, so the delay groups these tests register bother no other test."""
    data_dir = tmp_path_factory.mktemp("lone-meta")
    with running_role(["meta", "--data-dir", str(data_dir), "--port", "0"]) as meta:
        yield meta.ready["meta_server"]


def test_delay_role_alone_prints_ready_and_stops_cleanly(lone_meta: str, tmp_path: Path) -> None:
    url = lone_meta
    args = ["delay", "--data-dir", str(tmp_path / "d2"), "--meta-server", url, "--group", "d2", "--port", "0"]
    with running_role(args) as proc:
        assert proc.ready["role"] == "delay"
        assert proc.ready["group"] == "d2"
        assert proc.ready["address"].startswith("127.0.0.1:")
        assert proc.ready["http"].startswith("http://127.0.0.1:")
        assert int(proc.ready["pid"]) == proc.pid
        assert proc.stop(signal.SIGTERM) == 0
    assert (tmp_path / "d2" / "checkpoint").exists()  # the ordered shutdown checkpointed


def test_delay_role_startup_failures_exit_3_with_one_line(lone_meta: str, tmp_path: Path) -> None:
    no_meta = qmq("delay", "--data-dir", str(tmp_path / "d3"))
    assert no_meta.returncode == 3
    assert "needs --meta-server" in no_meta.stderr
    bad_bucket = qmq("delay", "--data-dir", str(tmp_path / "d3"), "--bucket-minutes", "2")
    assert bad_bucket.returncode == 2
    assert "bucket_minutes = '2' must be between 5 and 60" in bad_bucket.stderr
    busy = tmp_path / "busy"
    url = lone_meta
    with running_role(["delay", "--data-dir", str(busy), "--meta-server", url, "--group", "d4"]):
        second = qmq("delay", "--data-dir", str(busy), "--meta-server", url, "--group", "d5")
    assert second.returncode == 3
    assert "in use by another delay server" in second.stderr


async def test_without_a_delay_server_a_delayed_send_fails_saying_so(tmp_path: Path) -> None:
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0"]) as meta:
        url = meta.ready["meta_server"]
        with running_role(["broker", "--data-dir", str(tmp_path / "broker"), "--meta-server", url]):
            async with Producer(app_code="t", meta_server=url) as producer:
                m = producer.generate_message("no.delay")
                m.set_delay(60)
                with pytest.raises(SendError, match="no delay server is registered with the meta server"):
                    await producer.send(m)
                now = producer.generate_message("no.delay")
                await producer.send(now)  # realtime sends are unaffected


def test_standalone_ready_line_names_the_delay_role(shared_standalone: ReadyProcess) -> None:
    ready = shared_standalone.ready
    assert ready["delay"] == delay_group(shared_standalone.meta_server)["address"]
    os.kill(int(ready["delay_pid"]), 0)  # a live process of its own
    assert int(ready["delay_pid"]) not in (shared_standalone.pid, int(ready["broker_pid"]))


async def test_a_restart_over_a_large_write_ahead_log_still_takes_sends(lone_meta: str, tmp_path: Path) -> None:
    """What recovery finds counts as flushed: a log larger than pending_flush_bytes_max must not
    leave the restarted server refusing every send as busy."""
    data = tmp_path / "big-wal"
    args = ["delay", "--data-dir", str(data), "--meta-server", lone_meta, "--group", "d6"]
    args += ["--pending-flush-bytes-max", str(1 << 20), "--checkpoint-interval-ms", "3600000"]
    body = b"x" * 200_000
    for round_no in range(2):
        with running_role(args):
            async with Producer(app_code="t", meta_server=lone_meta, send_timeout_ms=5_000) as producer:
                for _ in range(8):  # 1.6 MB: more than pending_flush_bytes_max
                    m = producer.generate_message("big.wal")
                    m.body = body
                    m.set_delay(timedelta(hours=1))
                    await producer.send(m)
        assert sum(f.stat().st_size for f in (data / "wal").glob("*.log")) > (round_no + 1) * 1_500_000
