"""The meta server's HTTP calls of cluster operations (``qmq.meta.operations``); the CLI's
``qmq admin`` commands make the same calls.

    POST /meta/drain         {"group": G, "by": WHO}        no new sends to broker group G
    POST /meta/undrain       {"group": G, "by": WHO}        G writable again
    GET  /meta/routes?subject=S                              S's routes, each with its state
    POST /meta/routes        {"subject": S, "add": G | "remove": G, "by": WHO}
    POST /meta/remove-group  {"group": G, "by": WHO}        unregister a drained G for good
    GET  /meta/history[?limit=N]                             the latest N operations, oldest first

``by`` names who asks (``user@host`` from the CLI); without it, the caller's address. Answers:
200 with what was done, 400 for a bad field, 404 for an unknown group, 409 (the message says
why and what to do) when the operation would lose data or strand a subject.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Final

from aiohttp import web

from qmq.common.errors import InvalidSubjectError
from qmq.common.naming import check_name, check_subject
from qmq.meta.operations import HISTORY_LIMIT_MAX, Done, OperationRefusedError, Operations
from qmq.meta.payload import PayloadError
from qmq.meta.registry import UnknownGroupError
from qmq.meta.schema import OWNER_CHARS
from qmq.serving.http_auth import APP_KEY

HISTORY_LIMIT_DEFAULT: Final = 100

# (function, *args) run on the meta server's store thread
Call = Callable[..., typing.Awaitable[Any]]
BodyOf = Callable[[web.Request, str], typing.Awaitable[object]]


def _error(status: int, text: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": text}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


def _object(body: object, what: str) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise PayloadError("body", f"the {what} body must be a JSON object, got {type(body).__name__}")
    return body


def _group(body: dict[str, Any], field: str = "group") -> str:
    if field not in body:
        raise PayloadError(field, f'{field} is missing; send {{"{field}": "b1"}}')
    try:
        return check_name("group", body[field])
    except InvalidSubjectError as exc:
        raise PayloadError(field, str(exc)) from None


def _subject(value: object) -> str:
    try:
        return check_subject(value)
    except InvalidSubjectError as exc:
        raise PayloadError("subject", str(exc)) from None


def _who(body: dict[str, Any], request: web.Request) -> str:
    """Who asks: the ``by`` of the body, and the app it authenticated as when the meta server
    has an auth file (what the history can vouch for)."""
    who = body.get("by")
    app = request.get(APP_KEY)
    shown = f" (app {app.code})" if app is not None else ""
    if who is None:
        return f"unnamed@{request.remote or 'unknown'}{shown}"[:OWNER_CHARS]
    if not isinstance(who, str) or not who.strip() or len(who) > OWNER_CHARS - 64 or not who.isprintable():
        raise PayloadError(
            "by",
            f"by must name who asks (e.g. user@host), printable, up to {OWNER_CHARS - 64} characters; got {who!r:.80}",
        )
    return f"{who.strip()}{shown}"


def _done(done: Done, **extra: Any) -> web.Response:
    return web.json_response({"ok": True, "action": done.action, "target": done.target, "detail": done.detail, **extra})


class OperationsApi:
    """The handlers; ``call`` runs a function on the store thread, ``operations`` is read per request."""

    def __init__(self, call: Call, body_of: BodyOf, operations: Callable[[], Operations]) -> None:
        self._call = call
        self._body_of = body_of
        self._ops = operations

    def add_to(self, app: web.Application) -> None:
        app.router.add_post("/meta/drain", self._drain)
        app.router.add_post("/meta/undrain", self._undrain)
        app.router.add_get("/meta/routes", self._routes)
        app.router.add_post("/meta/routes", self._change_route)
        app.router.add_post("/meta/remove-group", self._remove_group)
        app.router.add_get("/meta/history", self._history)

    async def _run(self, request: web.Request, what: str, act: Callable[[dict[str, Any], str], Done]) -> web.Response:
        try:
            body = _object(await self._body_of(request, what), what)
            who = _who(body, request)
            done = await self._call(act, body, who)
        except PayloadError as exc:
            return _error(400, str(exc), exc.field)
        except UnknownGroupError as exc:
            return _error(404, str(exc), "group")
        except OperationRefusedError as exc:
            return _error(409, str(exc))
        return _done(done, by=who)

    async def _drain(self, request: web.Request) -> web.Response:
        return await self._run(request, "drain", lambda b, who: self._ops().drain(_group(b), who))

    async def _undrain(self, request: web.Request) -> web.Response:
        return await self._run(request, "undrain", lambda b, who: self._ops().undrain(_group(b), who))

    async def _remove_group(self, request: web.Request) -> web.Response:
        return await self._run(request, "remove-group", lambda b, who: self._ops().remove_group(_group(b), who))

    async def _change_route(self, request: web.Request) -> web.Response:
        def act(body: dict[str, Any], who: str) -> Done:
            subject = _subject(body.get("subject"))
            if ("add" in body) == ("remove" in body):
                raise PayloadError("add", 'send one of "add": GROUP or "remove": GROUP')
            if "add" in body:
                return self._ops().add_route(subject, _group(body, "add"), who)
            return self._ops().remove_route(subject, _group(body, "remove"), who)

        return await self._run(request, "routes", act)

    async def _routes(self, request: web.Request) -> web.Response:
        try:
            subject = _subject(request.query.get("subject"))
        except PayloadError as exc:
            return _error(400, str(exc), exc.field)
        routes = await self._call(lambda: self._ops().routes_of(subject))
        return web.json_response({"subject": subject, "routes": routes})

    async def _history(self, request: web.Request) -> web.Response:
        text = request.query.get("limit", str(HISTORY_LIMIT_DEFAULT))
        if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= HISTORY_LIMIT_MAX:
            return _error(400, f"limit {text!r} must be a whole number from 1 to {HISTORY_LIMIT_MAX}", "limit")
        entries = await self._call(lambda: self._ops().history(int(text)))
        return web.json_response(
            {
                "history": [
                    {
                        "id": e.id,
                        "at_ms": e.at_ms,
                        "who": e.who,
                        "action": e.action,
                        "target": e.target,
                        "detail": e.detail,
                    }
                    for e in entries
                ]
            }
        )
