"""`qmq top` against a real standalone: one refresh as JSON with rates, lag and each server's
CPU, memory, disk and connections; the live view for a couple of refreshes; Prometheus text read
back sample by sample."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import pytest

from qmq.aio import Consumer, Producer
from qmq.cli.top_commands import parse_samples
from qmq.testing import ReadyProcess

pytestmark = pytest.mark.integration


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=60, check=False)


@pytest.mark.timeout(150)
async def test_one_refresh_as_json_has_rates_lag_delay_and_servers(
    shared_standalone: ReadyProcess, subject: str
) -> None:
    meta = shared_standalone.meta_server
    async with Producer(app_code="top", meta_server=meta) as producer:
        await asyncio_gather_sends(producer, subject, 30)
    async with Consumer(app_code="top", meta_server=meta) as consumer:
        pull = consumer.pull_consumer(subject, "watchers", "earliest")
        batch = await pull.pull(10, 2_000)
        assert len(batch) == 10  # pulled, left unacknowledged: 20 behind, 10 unacked
        # sends all through the refresh's two snapshots make the rate
        async with Producer(app_code="top", meta_server=meta) as producer:
            top = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "qmq", "top", "--meta-server", meta, "--once", "--json", "--interval", "1.5",
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
            answered = asyncio.ensure_future(top.communicate())
            while not answered.done():
                await asyncio_gather_sends(producer, subject, 10)
            out, err = await answered
        assert top.returncode == 0, err
    doc = json.loads(out)
    [s] = [e for e in doc["subjects"] if e["subject"] == subject]
    assert s["stored_total"] >= 40
    assert s["in_per_s"] > 0
    [g] = [e for e in doc["groups"] if e["subject"] == subject and e["group"] == "watchers"]
    assert g["lag"] >= 20
    assert g["unacked"] == 10
    assert doc["interval_s"] >= 1.0
    roles = {srv["role"] for srv in doc["servers"]}
    assert roles == {"broker", "delay"}
    for srv in doc["servers"]:
        assert srv["error"] is None, srv
        assert srv["memory_bytes"] > 10 * 2**20, srv
        assert 0 < srv["disk_free_bytes"] <= srv["disk_total_bytes"], srv
        assert srv["cpu_percent"] is not None, srv
        assert srv["connections"] is not None, srv
    assert [d["group"] for d in doc["delay"]] == ["delay-1"]


async def asyncio_gather_sends(producer: Producer, subject: str, n: int) -> None:
    await asyncio.gather(*(producer.send(producer.generate_message(subject)) for _ in range(n)))


def test_the_live_view_refreshes_and_stops_after_count(shared_standalone: ReadyProcess) -> None:
    done = qmq("top", "--meta-server", shared_standalone.meta_server, "--count", "2", "--interval", "0.3")
    assert done.returncode == 0, done.stderr
    for title in ("subjects", "consumer groups", "delay backlog", "servers"):
        assert done.stdout.count(title) == 2, (title, done.stdout)


def test_json_needs_once_and_a_dead_meta_server_is_named() -> None:
    done = qmq("top", "--meta-server", "http://127.0.0.1:9/meta/address", "--json")
    assert done.returncode == 2
    assert "add --once" in done.stderr
    done = qmq("top", "--meta-server", "http://127.0.0.1:9/meta/address", "--once")
    assert done.returncode == 1
    assert "cannot reach the meta server at http://127.0.0.1:9" in done.stderr


def test_prometheus_text_is_read_sample_by_sample() -> None:
    text = (
        "# HELP qmq_x x\n# TYPE qmq_x counter\n"
        'qmq_x_total{subject="a",group="g \\"1\\""} 3.0\n'
        "qmq_y 1e+06\n"
        "qmq_z NaN\n"
        "garbage line\n"
    )
    samples = parse_samples(text)
    assert samples["qmq_x_total"] == {(("group", 'g "1"'), ("subject", "a")): 3.0}
    assert samples["qmq_y"] == {(): 1e6}
    assert "garbage" not in samples
