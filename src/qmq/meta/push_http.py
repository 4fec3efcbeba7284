"""The meta server's HTTP API of push subscriptions and their leases (docs/gateway.md, "Push").

Routes:
    GET    /meta/push                  every subscription (secrets shown as "***") and who holds it
    POST   /meta/push                  add one: a JSON subscription (qmq.protocol.push); 201, 409 when it exists
    DELETE /meta/push?subject=S&group=G   remove one; 404 when there is none
    POST   /meta/push/lease            a gateway renews its leases and takes free ones, up to its share:
                                       {"owner", "url", "lease_ms", "held_max"} -> {"lease_ms", "subscriptions":
                                       [{"subscription": {...with its secret}, "generation": n}]} it holds
    POST   /meta/push/release          {"owner"}: a gateway stopping gives up its leases at once

``qmq push add`` fixes where the consumer group starts before it adds the subscription here
(the meta server talks to no broker); a subscription added with this API alone starts where
the group stands, or at its first pull by the gateway.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final, TypeVar

from aiohttp import web

from qmq.common.clock import Clock
from qmq.common.errors import InvalidSubjectError
from qmq.common.naming import check_name
from qmq.meta.push_store import PushExistsError, PushFullError, PushRow, PushStore
from qmq.meta.schema import OWNER_CHARS, URL_CHARS
from qmq.protocol.push import PushFieldError, parse_subscription, subscription_json

T = TypeVar("T")

PUSH_PATH: Final = "/meta/push"
LEASE_PATH: Final = "/meta/push/lease"
RELEASE_PATH: Final = "/meta/push/release"
LEASE_MS_MIN: Final = 1_000
LEASE_MS_MAX: Final = 600_000
HELD_MAX: Final = 10_000

Call = Callable[..., Awaitable[Any]]


def _refused(status: int, text: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": text}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


def _lease_json(row: PushRow, now_ms: int) -> dict[str, Any]:
    return {
        "owner": row.owner or None,
        "owner_url": row.owner_url or None,
        "lease_expires_ms": row.lease_expires_ms,
        "leased": bool(row.owner) and row.lease_expires_ms >= now_ms,
        "lease_generation": row.lease_generation,
    }


async def _json_object(request: web.Request, what: str) -> dict[str, Any]:
    raw = await request.read()
    try:
        body = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise PushFieldError(
            "body", f"the {what} body is not JSON ({type(exc).__name__}); send a JSON object"
        ) from None
    if not isinstance(body, dict):
        raise PushFieldError("body", f"the {what} body must be a JSON object, got {type(body).__name__}")
    return body


def _short_string(body: dict[str, Any], field: str, chars_max: int, *, required: bool = True) -> str:
    value = body.get(field, None if required else "")
    if not isinstance(value, str) or (required and not value) or len(value) > chars_max:
        raise PushFieldError(
            field, f"{field} must be a non-empty string of at most {chars_max} characters, got {value!r}"
        )
    return value


def _whole(body: dict[str, Any], field: str, low: int, high: int, default: int) -> int:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PushFieldError(field, f"{field} {value!r} must be a whole number from {low} to {high}")
    return value


class PushApi:
    """The push routes of one meta server: ``call`` runs a function on its store thread."""

    def __init__(self, call: Call, store: Callable[[], PushStore], clock: Clock) -> None:
        self._call = call
        self._store = store
        self._clock = clock

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(PUSH_PATH, self._list)
        app.router.add_post(PUSH_PATH, self._add)
        app.router.add_delete(PUSH_PATH, self._remove)
        app.router.add_post(LEASE_PATH, self._lease)
        app.router.add_post(RELEASE_PATH, self._release)

    async def _list(self, _request: web.Request) -> web.Response:
        rows: list[PushRow] = await self._call(lambda: self._store().rows())
        now_ms = self._clock.now_ms()
        return web.json_response(
            {
                "time_ms": now_ms,
                "subscriptions": [
                    {**subscription_json(r.subscription, with_secret=False), **_lease_json(r, now_ms)} for r in rows
                ],
            }
        )

    async def _add(self, request: web.Request) -> web.Response:
        try:
            body = await _json_object(request, "push subscription")
            body.pop("created_at_ms", None)  # the meta server's time of adding, not the caller's
            sub = parse_subscription({**body, "created_at_ms": self._clock.now_ms()})
        except PushFieldError as exc:
            return _refused(400, str(exc), exc.field)
        try:
            await self._call(lambda: self._store().add(sub))
        except PushExistsError as exc:
            return _refused(409, str(exc), "group")
        except PushFullError as exc:
            return _refused(409, str(exc))
        return web.json_response({"subscription": subscription_json(sub, with_secret=False)}, status=201)

    async def _remove(self, request: web.Request) -> web.Response:
        try:
            subject = check_name("subject", request.query.get("subject", ""))
            group = check_name("consumer group", request.query.get("group", ""))
        except InvalidSubjectError as exc:
            return _refused(400, f"{exc}; remove with DELETE {PUSH_PATH}?subject=S&group=G")
        removed: bool = await self._call(lambda: self._store().remove(subject, group))
        if not removed:
            return _refused(404, f"there is no push subscription of subject {subject!r} for group {group!r}", "group")
        return web.json_response({"removed": True, "subject": subject, "group": group})

    async def _lease(self, request: web.Request) -> web.Response:
        try:
            body = await _json_object(request, "lease")
            owner = _short_string(body, "owner", OWNER_CHARS)
            url = _short_string(body, "url", URL_CHARS, required=False)
            lease_ms = _whole(body, "lease_ms", LEASE_MS_MIN, LEASE_MS_MAX, 6_000)
            held_max = _whole(body, "held_max", 0, HELD_MAX, HELD_MAX)
        except PushFieldError as exc:
            return _refused(400, str(exc), exc.field)
        now_ms = self._clock.now_ms()
        rows: list[PushRow] = await self._call(lambda: self._store().lease(owner, url, now_ms, lease_ms, held_max))
        return web.json_response(
            {
                "time_ms": now_ms,
                "lease_ms": lease_ms,
                "subscriptions": [
                    {
                        "subscription": subscription_json(r.subscription, with_secret=True),
                        "generation": r.lease_generation,
                    }
                    for r in rows
                ],
            }
        )

    async def _release(self, request: web.Request) -> web.Response:
        try:
            owner = _short_string(await _json_object(request, "release"), "owner", OWNER_CHARS)
        except PushFieldError as exc:
            return _refused(400, str(exc), exc.field)
        released: int = await self._call(lambda: self._store().release(owner))
        return web.json_response({"released": released})
