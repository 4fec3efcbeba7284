"""Quotas set at run time (`qmq limits set`), kept by the meta server, in ``qmq_meta_limits``:

    GET    /meta/limits                           every row: {"limits": [{app, pattern, rates...}]}
    PUT    /meta/limits                           set one: {"app", "pattern", "produce_msgs_per_s",
                                                  "produce_bytes_per_s", "consume_msgs_per_s"} (0: no limit)
    DELETE /meta/limits?app=A&pattern=P           remove one; 404 when there is none

With an auth file, reading needs any known app and a change an admin app (qmq.meta.server).
Brokers and delay servers ask every 0.4 s and apply a row on top of the auth file's quotas
for the same app (qmq.serving.limits), so a change holds everywhere within a second.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

import sqlalchemy as sa
from aiohttp import web

from qmq.auth.quotas import RATE_MAX
from qmq.meta.schema import LIMIT_APP_CHARS, LIMIT_PATTERN_CHARS, limits_table
from qmq.meta.store import MetaStore, MetaStoreError

LIMITS_PATH: Final = "/meta/limits"
LIMITS_MAX: Final = 10_000
RATE_FIELDS: Final = ("produce_msgs_per_s", "produce_bytes_per_s", "consume_msgs_per_s")

Call = Callable[..., Awaitable[Any]]


class LimitsFullError(MetaStoreError):
    retriable = False


class LimitsStore:
    def __init__(self, store: MetaStore) -> None:
        self._store = store

    def put(self, row: dict[str, Any], now_ms: int) -> None:
        t = limits_table
        with self._store.transaction("set a limit") as conn:
            key = (t.c.app == row["app"]) & (t.c.pattern == row["pattern"])
            if conn.execute(sa.update(t).where(key).values(**row, updated_ms=now_ms)).rowcount:
                return
            count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
            if count >= LIMITS_MAX:
                raise LimitsFullError(f"the meta server keeps at most {LIMITS_MAX} limits; remove one first")
            conn.execute(sa.insert(t).values(**row, updated_ms=now_ms))

    def remove(self, app: str, pattern: str) -> bool:
        t = limits_table
        with self._store.transaction("remove a limit") as conn:
            return int(conn.execute(sa.delete(t).where(t.c.app == app, t.c.pattern == pattern)).rowcount) > 0

    def rows(self) -> list[dict[str, Any]]:
        t = limits_table
        with self._store.transaction("read the limits") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.app, t.c.pattern).limit(LIMITS_MAX)).all()
        return [dict(r._mapping) for r in rows]


class LimitError(ValueError):
    """A field of a limit is wrong; the text names it."""


def parse_limit(doc: object) -> dict[str, Any]:
    """The row of a PUT body; LimitError naming the field at fault."""
    if not isinstance(doc, dict):
        raise LimitError("the body must be a JSON object {app, pattern, produce_msgs_per_s, ...}")
    row: dict[str, Any] = {}
    for field, chars in (("app", LIMIT_APP_CHARS), ("pattern", LIMIT_PATTERN_CHARS)):
        value = doc.get(field)
        if not isinstance(value, str) or not value or len(value) > chars:
            raise LimitError(f"{field} must be a non-empty string of at most {chars} characters, got {value!r}")
        row[field] = value
    unknown = sorted(set(doc) - {"app", "pattern", *RATE_FIELDS})
    if unknown:
        raise LimitError(f"unknown field(s) {', '.join(unknown)}; known: app, pattern, {', '.join(RATE_FIELDS)}")
    for field in RATE_FIELDS:
        value = doc.get(field, 0)
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= RATE_MAX:
            raise LimitError(f"{field} = {value!r} must be a number from 0 (no limit) to {RATE_MAX:g}")
        row[field] = float(value)
    return row


class LimitsApi:
    """The limit routes of one meta server: ``call`` runs a function on its store thread."""

    def __init__(self, call: Call, store: Callable[[], LimitsStore], now_ms: Callable[[], int]) -> None:
        self._call = call
        self._store = store
        self._now_ms = now_ms

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(LIMITS_PATH, self._list)
        app.router.add_put(LIMITS_PATH, self._put)
        app.router.add_delete(LIMITS_PATH, self._remove)

    async def _list(self, _request: web.Request) -> web.Response:
        rows = await self._call(lambda: self._store().rows())
        return web.json_response({"limits": rows})

    async def _put(self, request: web.Request) -> web.Response:
        try:
            row = parse_limit(json.loads(await request.read()))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return web.json_response({"error": f"{exc}"}, status=400)
        try:
            await self._call(lambda: self._store().put(row, self._now_ms()))
        except LimitsFullError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"ok": True, "limit": row})

    async def _remove(self, request: web.Request) -> web.Response:
        app, pattern = request.query.get("app", ""), request.query.get("pattern", "")
        removed = await self._call(lambda: self._store().remove(app, pattern))
        if not removed:
            return web.json_response({"error": f"no limit of app {app!r} for pattern {pattern!r}"}, status=404)
        return web.json_response({"ok": True})
