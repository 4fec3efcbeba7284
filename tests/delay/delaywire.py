"""Helpers of the delay integration tests: collecting messages with receipt times, and raw requests
to the delay server found through the meta server."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from typing import Any

from qmq.aio import PullConsumer
from qmq.client.connection import Connection
from qmq.protocol.frame import Frame


def now_ms() -> float:
    return time.time() * 1000


async def collect(pull: PullConsumer, count: int, timeout_s: float) -> dict[str, float]:
    """Pull and ack until ``count`` messages came (or the deadline): message id -> receipt time (ms).

    A message received twice fails the test at once.
    """
    got: dict[str, float] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        batch = await pull.pull(max_messages=500, timeout_ms=200)
        at = now_ms()
        for m in batch:
            assert m.message_id not in got, f"message {m.message_id} was delivered twice"
            got[m.message_id] = at
        await batch.ack_all()
    return got


def meta_address(meta_server: str) -> dict[str, Any]:
    with urllib.request.urlopen(meta_server, timeout=5) as resp:
        doc: dict[str, Any] = json.loads(resp.read())
    return doc


def delay_group(meta_server: str, name: str = "delay-1") -> dict[str, Any]:
    groups = [g for g in meta_address(meta_server)["delay_groups"] if g["group"] == name]
    assert groups, f"the meta server lists no delay group {name!r}"
    return groups[0]


async def request(address: str, code: int, header: dict[str, Any], body: list[bytes] | None = None) -> Frame:
    conn = Connection(address, connect_timeout_ms=5000)
    try:
        return await conn.request(code, header, body or [])
    finally:
        await conn.close()


async def wait_until(what: str, check: Any, timeout_s: float, interval_s: float = 0.05) -> Any:
    """Poll ``check()`` (sync or async) until it returns something truthy; fail at the deadline."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if asyncio.iscoroutine(last):
            last = await last
        if last:
            return last
        await asyncio.sleep(interval_s)  # polling a condition, bounded by the deadline
    raise AssertionError(f"{what} did not happen within {timeout_s} s (last: {last!r})")
