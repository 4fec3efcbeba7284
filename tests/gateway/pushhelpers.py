"""A real HTTP receiver for push deliveries (aiohttp on 127.0.0.1 port 0) and the `qmq push`
command, for the push tests."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

WAIT_S = 60.0


@dataclass
class Delivery:
    """One POST the receiver got: its headers, raw body and decoded JSON, and what it answered."""

    headers: dict[str, str]
    body: bytes
    doc: dict[str, Any]
    status: int = 0

    @property
    def message_id(self) -> str:
        return str(self.doc["message_id"])


Answer = Callable[[Delivery], Awaitable[int]]


async def answer_200(_d: Delivery) -> int:
    return 200


@dataclass
class Receiver:
    """Records every delivery; ``answer`` decides each status (it may wait, to hold a delivery)."""

    answer: Answer = answer_200
    url: str = ""
    deliveries: list[Delivery] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        d = Delivery({k.lower(): v for k, v in request.headers.items()}, body, json.loads(body))
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        self._note()
        try:
            d.status = await self.answer(d)
        finally:
            self.in_flight -= 1
            self.deliveries.append(d)
            self._note()
        return web.Response(status=d.status, text="ok" if d.status < 300 else "no")

    def _note(self) -> None:
        self.changed.set()

    def ok(self) -> list[Delivery]:
        return [d for d in self.deliveries if 200 <= d.status < 300]

    async def wait_until(self, what: str, predicate: Callable[[], bool], timeout_s: float = WAIT_S) -> None:
        """Return once ``predicate()`` holds, checked at every delivery; AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while not predicate():
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(
                    f"waited {timeout_s} s for {what}; got {[(d.message_id, d.status) for d in self.deliveries]}"
                )
            self.changed.clear()
            # at least once a second: the condition may be on something besides deliveries
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.changed.wait(), min(left, 1.0))


@asynccontextmanager
async def running_receiver(answer: Answer = answer_200, path: str = "/hook") -> AsyncIterator[Receiver]:
    receiver = Receiver(answer)
    app = web.Application()
    app.router.add_post(path, receiver.handle)
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    receiver.url = f"http://127.0.0.1:{port}{path}"
    try:
        yield receiver
    finally:
        await runner.cleanup()


def qmq_push(*args: str, meta_server: str) -> subprocess.CompletedProcess[str]:
    """``qmq push ARGS --meta-server URL`` as a child process; its output and status."""
    return subprocess.run(
        [sys.executable, "-m", "qmq", "push", *args, "--meta-server", meta_server],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


def push_add(subject: str, group: str, url: str, *extra: str, meta_server: str) -> None:
    done = qmq_push("add", subject, "--group", group, "--url", url, *extra, meta_server=meta_server)
    assert done.returncode == 0, done.stderr


def remove_every_subscription(meta_server: str) -> None:
    """Remove every push subscription of the meta server, so the next test's gateway takes only its own."""
    listed = qmq_push("list", "--json", meta_server=meta_server)
    assert listed.returncode == 0, listed.stderr
    for s in json.loads(listed.stdout)["subscriptions"]:
        done = qmq_push("remove", s["subject"], "--group", s["group"], meta_server=meta_server)
        assert done.returncode == 0, done.stderr


async def group_settled(meta_server: str, subject: str, group: str) -> bool:
    """Whether ``group`` has nothing left to pull and nothing unacknowledged on every broker group."""
    from qmq.cli.admin import ask_every_broker
    from qmq.protocol.codes import RequestCode

    answers = await ask_every_broker(meta_server, RequestCode.LAG, {"subject": subject, "group": group})
    return all(isinstance(h, dict) and h["backlog"] == 0 and h["unacked"] == 0 for h in answers.values())


async def wait_settled(meta_server: str, subject: str, group: str, timeout_s: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not await group_settled(meta_server, subject, group):
        assert time.monotonic() < deadline, f"group {group} of {subject} still has messages after {timeout_s} s"
        await asyncio.sleep(0.1)  # polling the brokers' LAG, bounded by the deadline
