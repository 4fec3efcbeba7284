"""Backlog alarms: `qmq alarm add/list/remove` against a real standalone, notifications received by
a real HTTP server — one signed notice when a breach starts, one when it ends, none in between —
the alarm kept across a restart; and the state machine that keeps a wavering lag from making a
storm."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from qmq.aio import Consumer, Producer
from qmq.gateway.push_delivery import signature as push_signature
from qmq.meta.alarms import Alarm, next_state
from qmq.testing import ReadyProcess, running_standalone

SECRET = "alarm-secret"
# short heartbeats and ticks, so a breach is seen within a second
CONFIG = {"meta": {"heartbeat_timeout_ms": 2_000}, "broker": {"heartbeat_interval_ms": 100}}


def qmq(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=60, check=False
    )


class Receiver:
    """A webhook on 127.0.0.1 port 0 keeping every notification it is sent."""

    def __init__(self) -> None:
        self.got: list[tuple[dict[str, str], bytes]] = []
        self.arrived = asyncio.Event()
        self.url = ""

    async def handle(self, request: web.Request) -> web.Response:
        self.got.append((dict(request.headers), await request.read()))
        self.arrived.set()
        return web.Response(status=204)

    async def wait_for(self, count: int, timeout_s: float = 30.0) -> None:
        async with asyncio.timeout(timeout_s):
            while len(self.got) < count:
                self.arrived.clear()
                await self.arrived.wait()


@pytest.fixture
async def receiver() -> AsyncIterator[Receiver]:
    r = Receiver()
    app = web.Application()
    app.router.add_post("/hook", r.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    r.url = f"http://127.0.0.1:{port}/hook"
    yield r
    await runner.cleanup()


def alarms(meta_server: str) -> list[dict[str, Any]]:
    """``qmq alarm list --json``'s alarms."""
    done = qmq("alarm", "list", "--meta-server", meta_server, "--json")
    assert done.returncode == 0, done.stderr
    return list(json.loads(done.stdout)["alarms"])


def alarms_http(meta_server: str) -> list[dict[str, Any]]:
    """The same from ``GET /meta/alarms`` (no process to start: for polling)."""
    url = meta_server.removesuffix("/meta/address") + "/meta/alarms"
    with urllib.request.urlopen(url, timeout=10) as answer:
        return list(json.loads(answer.read())["alarms"])


async def wait_checks(meta_server: str, after_ms: int, checks: int = 3) -> None:
    """Until the leader has checked the alarms ``checks`` times more (a tick is 500 ms here)."""
    async with asyncio.timeout(30):
        while True:
            [a] = await asyncio.to_thread(alarms_http, meta_server)
            if a["checked_ms"] >= after_ms + checks * 500:
                return
            await asyncio.sleep(0.2)  # polling the meta server's own record


@pytest.mark.integration
@pytest.mark.timeout(240)
async def test_one_signed_notice_when_a_breach_starts_one_when_it_ends_and_the_alarm_survives_a_restart(
    tmp_path: Path, receiver: Receiver
) -> None:
    data_dir = tmp_path / "qmq-data"
    subject, group = "orders.alarmed", "billing"
    with running_standalone(data_dir, CONFIG) as standalone:
        meta = standalone.meta_server
        done = qmq(
            "alarm", "add", subject, "--group", group, "--lag-over", "5", "--for", "0",
            "--webhook", receiver.url, "--secret", SECRET, "--meta-server", meta,
        )
        assert done.returncode == 0, done.stderr
        refused = qmq("alarm", "add", subject, "--group", group, "--lag-over", "5", "--webhook", receiver.url,
                      "--meta-server", meta)
        assert refused.returncode != 0
        assert "exists already" in refused.stderr
        async with Consumer(app_code="alarms", meta_server=meta) as consumer:
            pull = consumer.pull_consumer(subject, group, "earliest")
            assert list(await pull.pull(10, 100)) == []  # the group exists on the broker now
            async with Producer(app_code="alarms", meta_server=meta) as producer:
                await asyncio.gather(*(producer.send(producer.generate_message(subject)) for _ in range(20)))
            await receiver.wait_for(1)
            taken = []
            while len(taken) < 20:
                batch = await pull.pull(20, 2_000)
                taken += batch
                batch.ack_all()
            await consumer.flush_acks()
            await receiver.wait_for(2)
            ended_ms = max(a["checked_ms"] for a in alarms_http(meta))
            await wait_checks(meta, ended_ms)
        assert len(receiver.got) == 2, "one notice a start and one an end, nothing more"
        docs = []
        for headers, body in receiver.got:
            assert headers["X-Qmq-Signature"] == push_signature(SECRET, body), "signed as HTTP push is"
            doc = json.loads(body)
            assert headers["X-Qmq-Alarm-Event"] == doc["event"]
            docs.append(doc)
        assert [d["event"] for d in docs] == ["breach_started", "breach_ended"]
        assert docs[0]["lag"] == 20
        assert docs[1]["lag"] == 0
        assert {(d["subject"], d["group"], d["lag_over"]) for d in docs} == {(subject, group, 5)}
    with running_standalone(data_dir, CONFIG) as again:
        [kept] = alarms(again.meta_server)
        assert (kept["subject"], kept["group"], kept["lag_over"], kept["state"]) == (subject, group, 5, "ok")
        assert kept["secret"] == "***"
        done = qmq("alarm", "remove", subject, "--group", group, "--meta-server", again.meta_server)
        assert done.returncode == 0, done.stderr
        assert alarms(again.meta_server) == []
        missing = qmq("alarm", "remove", subject, "--group", group, "--meta-server", again.meta_server)
        assert missing.returncode != 0
        assert "there is no alarm" in missing.stderr


def test_bad_alarm_input_is_refused_naming_the_value(shared_standalone: ReadyProcess) -> None:
    meta = shared_standalone.meta_server
    done = qmq("alarm", "add", "s", "--group", "g", "--lag-over", "5", "--webhook", "ftp://x", "--meta-server", meta)
    assert done.returncode != 0
    assert "webhook 'ftp://x'" in done.stderr
    done = qmq("alarm", "add", "s", "--group", "g", "--lag-over", "5", "--for", "soon", "--webhook", "http://x",
               "--meta-server", meta)
    assert done.returncode != 0
    assert "'soon' is not a duration" in done.stderr


def _alarm(for_ms: int, state: str = "ok", since_ms: int = 0) -> Alarm:
    return Alarm("s", "g", 10, for_ms, "http://x", "", 0, state, since_ms)  # type: ignore[arg-type]


def test_a_wavering_lag_notifies_once_each_way() -> None:
    a = _alarm(for_ms=1_000)
    assert next_state(a, 11, True, 100) == ("pending", None)
    assert next_state(_alarm(1_000, "pending", 100), 5, True, 500) == ("ok", None), "too short: never notified"
    assert next_state(_alarm(1_000, "pending", 100), 11, True, 1_100) == ("firing", "breach_started")
    assert next_state(_alarm(1_000, "firing", 1_100), 5, True, 1_200) == ("clearing", None)
    assert next_state(_alarm(1_000, "clearing", 1_200), 50, True, 1_300) == ("firing", None), "the breach goes on"
    assert next_state(_alarm(1_000, "clearing", 1_200), 5, True, 2_200) == ("ok", "breach_ended")
    assert next_state(_alarm(0), 11, True, 0) == ("firing", "breach_started")
    assert next_state(_alarm(0, "firing"), 10, True, 0) == ("ok", "breach_ended")
    # a lag known only to be at most 50 (a cut report) changes nothing; at most 8 is known under
    assert next_state(_alarm(0, "firing"), 50, False, 0) == ("firing", None)
    assert next_state(_alarm(0), 50, False, 0) == ("ok", None)
    assert next_state(_alarm(0, "firing"), 8, False, 0) == ("ok", "breach_ended")
