"""Records a server keeps asking its meta server for (``GET`` of one JSON document every few
seconds): run-time limits, group controls. One poll loop for all of them: a meta server that
cannot be asked leaves the last records in force, and the failure is logged once and then every
so often, never per poll."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

import aiohttp

from qmq.common.config import meta_base_url

log = logging.getLogger(__name__)

_REQUEST_TIMEOUT_S = 5.0
_LOG_EVERY = 30  # failures in a row between two warnings


class MetaPoller:
    """Calls ``on_doc`` with the JSON object ``GET path`` answers, every ``poll_s``."""

    def __init__(
        self,
        meta_server: str,
        path: str,
        what: str,
        on_doc: Callable[[dict[str, Any]], None],
        authorization: str | None,
        ssl: SSLContext | None,
        poll_s: float,
    ) -> None:
        self.url = f"{meta_base_url(meta_server)}{path}"
        self._what = what  # for the log: "the limits", "the group controls"
        self._on_doc = on_doc
        self._headers = {"Authorization": authorization} if authorization else {}
        self._ssl = ssl
        self._poll_s = poll_s
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        connector = aiohttp.TCPConnector(ssl=self._ssl) if self._ssl is not None else None
        async with aiohttp.ClientSession(
            timeout=aiohttp.ClientTimeout(total=_REQUEST_TIMEOUT_S), headers=self._headers, connector=connector
        ) as session:
            failures = 0
            while True:
                try:
                    async with session.get(self.url) as resp:
                        doc: Any = await resp.json(content_type=None)
                        if resp.status != 200 or not isinstance(doc, dict):
                            raise RuntimeError(f"HTTP {resp.status}: {doc}")
                    self._on_doc(doc)
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the meta server may be down: keep the last records, ask again
                    failures += 1
                    if failures == 1 or failures % _LOG_EVERY == 0:
                        log.warning("cannot read %s at %s (%d time(s)): %s", self._what, self.url, failures, exc)
                await asyncio.sleep(self._poll_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
