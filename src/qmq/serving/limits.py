"""Quotas set at run time, fetched from the meta server (``GET /meta/limits``, qmq.meta.limits)
every ``POLL_S`` by a broker or delay server with an auth file, and handed to its auth gate,
which applies them on top of the auth file's. A meta server that cannot be asked leaves the
last rows in force; a row that cannot be read is logged and skipped."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from ssl import SSLContext
from typing import Any

import aiohttp

from qmq.auth.permissions import parse_consume_patterns
from qmq.auth.quotas import Quota, QuotaRule
from qmq.common.config import meta_base_url
from qmq.common.errors import ConfigError

log = logging.getLogger(__name__)

POLL_S = 2.0
_REQUEST_TIMEOUT_S = 5.0
_ROWS_MAX = 10_000


def rules_of(rows: object) -> dict[str, tuple[QuotaRule, ...]]:
    """The quota rules of ``GET /meta/limits`` rows, by app."""
    out: dict[str, list[QuotaRule]] = {}
    if not isinstance(rows, list):
        return {}
    for row in rows[:_ROWS_MAX]:
        try:
            if not isinstance(row, dict) or not isinstance(row.get("app"), str):
                raise ConfigError(f"not a limit row: {row!r}")
            [pattern] = parse_consume_patterns([row.get("pattern")], f"limit of app {row['app']!r}")
            quota = Quota(
                float(row.get("produce_msgs_per_s", 0)),
                float(row.get("produce_bytes_per_s", 0)),
                float(row.get("consume_msgs_per_s", 0)),
            )
        except (ConfigError, TypeError, ValueError) as exc:
            log.warning("skipping a limit of the meta server: %s", exc)
            continue
        out.setdefault(row["app"], []).append(QuotaRule(pattern, quota))
    return {app: tuple(rules) for app, rules in out.items()}


class LimitsPoller:
    def __init__(
        self,
        meta_server: str,
        on_rules: Callable[[dict[str, tuple[QuotaRule, ...]]], None],
        authorization: str | None,
        ssl: SSLContext | None,
    ) -> None:
        self.url = f"{meta_base_url(meta_server)}/meta/limits"
        self._on_rules = on_rules
        self._headers = {"Authorization": authorization} if authorization else {}
        self._ssl = ssl
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
                    self._on_rules(rules_of(doc.get("limits")))
                    failures = 0
                except asyncio.CancelledError:
                    raise
                except Exception as exc:  # the meta server may be down: keep the last limits, ask again
                    failures += 1
                    if failures == 1 or failures % 30 == 0:
                        log.warning("cannot read the limits at %s (%d time(s)): %s", self.url, failures, exc)
                await asyncio.sleep(POLL_S)  # the poll period

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
