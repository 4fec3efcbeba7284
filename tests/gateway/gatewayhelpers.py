"""HTTP calls of the gateway tests (a helper module the test modules import by name)."""

from __future__ import annotations

import time
from typing import Any

import aiohttp


async def post(http: aiohttp.ClientSession, url: str, doc: object) -> tuple[int, Any]:
    async with http.post(url, json=doc) as resp:
        return resp.status, await resp.json()


async def get(http: aiohttp.ClientSession, url: str) -> tuple[int, Any]:
    async with http.get(url) as resp:
        return resp.status, await resp.json()


async def pull_until(
    http: aiohttp.ClientSession, url: str, count: int, deadline_s: float, **body: Any
) -> list[dict[str, Any]]:
    """Long polls of ``url`` until ``count`` messages came or ``deadline_s`` passed."""
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + deadline_s
    while len(got) < count and time.monotonic() < deadline:
        status, doc = await post(http, url, {"max_messages": count - len(got), "timeout_ms": 500, **body})
        assert status == 200, doc
        got += doc["messages"]
    return got
