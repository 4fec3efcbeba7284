"""A message's trace context reaches an HTTP push receiver: sent through the gateway with a
`traceparent` header, delivered by the gateway's push with the same `traceparent`."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator

import aiohttp
import pytest
from aiohttp import web

from qmq.testing import ReadyProcess

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]


def qmq_push(*args: str, meta_server: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "push", *args, "--meta-server", meta_server],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, asyncio.Queue[dict[str, str]]]]:
    got: asyncio.Queue[dict[str, str]] = asyncio.Queue()

    async def handle(request: web.Request) -> web.Response:
        await request.read()
        got.put_nowait({k.lower(): v for k, v in request.headers.items()})
        return web.Response(status=204)

    app = web.Application()
    app.router.add_post("/hook", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}/hook", got
    await runner.cleanup()


async def test_a_pushed_message_carries_the_senders_traceparent(
    shared_standalone: ReadyProcess, subject: str, receiver: tuple[str, asyncio.Queue[dict[str, str]]]
) -> None:
    meta = shared_standalone.meta_server
    url, got = receiver
    group = f"push-{uuid.uuid4().hex[:8]}"
    added = await asyncio.to_thread(qmq_push, "add", subject, "--group", group, "--url", url, meta_server=meta)
    assert added.returncode == 0, added.stderr
    traceparent = f"00-{uuid.uuid4().hex}-{uuid.uuid4().hex[:16]}-01"
    try:
        async with aiohttp.ClientSession() as http:
            answer = await http.post(
                f"{shared_standalone.gateway}/v1/subjects/{subject}/messages",
                json={"body": "traced"},
                headers={"traceparent": traceparent},
            )
            assert answer.status == 200, await answer.text()
        headers = await asyncio.wait_for(got.get(), 90)
    finally:
        removed = await asyncio.to_thread(qmq_push, "remove", subject, "--group", group, meta_server=meta)
        assert removed.returncode == 0, removed.stderr
    assert headers["traceparent"] == traceparent
    assert "tracestate" not in headers
