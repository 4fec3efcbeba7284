"""Registration with the meta server: a server reports itself at start and on every heartbeat
(``POST /meta/register``), so clients find it in ``GET /meta/address``."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Callable
from typing import Any

import aiohttp

from qmq.common.config import meta_base_url

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 5.0
_RETRY_S_MIN = 0.05
_RETRY_S_MAX = 2.0


def register_url(meta_server: str) -> str:
    """``http://host:port/meta/address`` (as printed by ``qmq ready``) → ``http://host:port/meta/register``."""
    return f"{meta_base_url(meta_server)}/meta/register"


def server_payload(role: str, group: str, address: str, http: str) -> dict[str, Any]:
    return {"role": role, "group": group, "address": address, "http": http, "pid": os.getpid()}


class Registration:
    """Heartbeats to the meta server. ``payload`` may be a function (re-read for every
    heartbeat, for servers that report their state); ``on_answer`` gets the meta server's
    answer to each one (it tells cluster members their role, docs/cluster.md)."""

    def __init__(
        self,
        meta_server: str,
        payload: dict[str, Any] | Callable[[], dict[str, Any]],
        interval_ms: int,
        on_answer: Callable[[dict[str, Any]], None] | None = None,
        authorization: str | None = None,
    ) -> None:
        self.url = register_url(meta_server)
        # the Authorization header of the server's own app, for a meta server with an auth file
        self._headers = {"Authorization": authorization} if authorization else {}
        self.payload = payload
        self.on_answer = on_answer
        self.interval_s = interval_ms / 1000
        self._wake = asyncio.Event()
        self.registered = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        self._session = aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S), headers=self._headers
        )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._session is not None
        retry_s = _RETRY_S_MIN
        while True:
            try:
                payload = self.payload() if callable(self.payload) else self.payload
                async with self._session.post(self.url, json=payload) as resp:
                    body = await resp.json(content_type=None)
                    if resp.status != 200:
                        raise RuntimeError(f"HTTP {resp.status}: {body}")
                if not self.registered.is_set():
                    log.info("registered with the meta server at %s as %s", self.url, payload)
                if self.on_answer is not None and isinstance(body, dict):
                    self.on_answer(body)
                self.registered.set()
                retry_s = _RETRY_S_MIN
                self._wake.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), self.interval_s)  # the heartbeat period
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the meta server may be down or restarting: keep trying
                log.warning("meta server %s did not take the heartbeat: %s; retrying", self.url, exc)
                await asyncio.sleep(retry_s)  # bounded exponential back-off
                retry_s = min(_RETRY_S_MAX, retry_s * 2)

    def beat_now(self) -> None:
        """Send the next heartbeat at once (the server's state changed)."""
        self._wake.set()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._session is not None:
            await self._session.close()
