"""HTTP push across a restart of the meta server: `kill -9` of the meta server of a real standalone
(its supervisor starts it again on the same port); the subscription is still there, the
standalone's gateway holds or takes back its lease, and every message sent before, during and after is delivered."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

import pytest
from pushhelpers import push_add, qmq_push, running_receiver

from qmq.aio import Producer
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _meta_pids(supervisor_pid: int) -> list[int]:
    """pids of the supervisor's children running `qmq meta`."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == supervisor_pid and b"meta" in cmdline:
            out.append(int(entry.name))
    return out


def _wait_meta_back(base: str, supervisor_pid: int, old_pid: int, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, f"the meta server did not come back within {timeout_s} s"
        if [p for p in _meta_pids(supervisor_pid) if p != old_pid]:
            try:
                with urllib.request.urlopen(base + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
        time.sleep(0.1)  # polling the process table and /health, bounded by the deadline


async def test_push_goes_on_across_a_meta_server_restart(tmp_path: Path) -> None:
    port = _free_port()
    subject, group = f"test.{uuid.uuid4().hex[:12]}", "restart"
    with running_standalone(tmp_path / "qmq-data", extra_args=["--meta-port", str(port)]) as proc:
        meta_server = proc.meta_server
        base = meta_server.removesuffix("/meta/address")
        assert base == f"http://127.0.0.1:{port}"
        async with running_receiver() as rx:
            push_add(subject, group, rx.url, meta_server=meta_server)
            async with Producer(app_code="shop", meta_server=meta_server) as producer:

                async def send(n: int) -> list[str]:
                    messages = [producer.generate_message(subject) for _ in range(n)]
                    await asyncio.gather(*(producer.send(m) for m in messages))
                    return [m.message_id for m in messages]

                sent = await send(5)
                await rx.wait_until("the first five", lambda: len(rx.ok()) == 5)
                meta_pid = proc.pid_of("meta")
                os.kill(meta_pid, signal.SIGKILL)
                sent += await send(5)  # the producer knows its broker: sends go on without the meta server
                await asyncio.to_thread(_wait_meta_back, base, proc.pid, meta_pid)
                sent += await send(5)
                await rx.wait_until("all fifteen", lambda: {d.message_id for d in rx.ok()} >= set(sent))
        listed = json.loads(qmq_push("list", "--json", meta_server=meta_server).stdout)["subscriptions"]
        assert [(s["subject"], s["group"], s["url"]) for s in listed] == [(subject, group, rx.url)]
        assert f"-gateway-{proc.ready['gateway_pid']}-" in listed[0]["owner"]
