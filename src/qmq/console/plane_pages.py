"""Push subscriptions (``/console/push``) and backlog alarms (``/console/alarms``): list, add,
remove — the meta server calls of ``qmq push add|list|remove`` and ``qmq alarm add|list|remove``."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from qmq.console.base import ActionRefused, Console, action, changed, field, flash, page


def add_routes(console: Console, app: web.Application) -> None:
    r = app.router
    r.add_get("/console/push", page(console, push_page))
    r.add_post("/console/push/add", action(console, _push_add))
    r.add_post("/console/push/remove", action(console, _push_remove))
    r.add_get("/console/alarms", page(console, alarms_page))
    r.add_post("/console/alarms/add", action(console, _alarm_add))
    r.add_post("/console/alarms/remove", action(console, _alarm_remove))


async def _meta(console: Console, method: str, path: str, body: object = None, params: Any = None) -> Any:
    from qmq.cli.push_commands import _base, _meta_request

    return await _meta_request(method, _base(console.meta_server) + path, body, params)


def _int(form: Any, name: str, default: int) -> int:
    text = field(form, name, required=False)
    if not text:
        return default
    try:
        return int(text)
    except ValueError:
        raise ActionRefused(f"{name.replace('_', ' ')} {text!r} is not a whole number; give one") from None


async def _listing_page(
    console: Console, request: web.Request, name: str, key: str, title: str
) -> web.StreamResponse:
    """The page of the meta server's ``/meta/NAME`` list (``key`` in its answer), or with
    ``?part=list`` only its list, as the page's refresh asks for it."""
    doc = await _meta(console, "GET", f"/meta/{name}")
    context = {key: doc[key], "time_ms": doc.get("time_ms", 0)}
    if request.query.get("part") == "list":
        return console.render(f"{name}_list.html", **context)
    return console.render(f"{name}.html", title=title, active=name, **context)


async def push_page(console: Console, request: web.Request) -> web.StreamResponse:
    return await _listing_page(console, request, "push", "subscriptions", "Push subscriptions")


async def _push_add(console: Console, request: web.Request) -> web.StreamResponse:
    """As ``qmq push add``: checked as the meta server will check it, the group started at the
    end of the subject for ``latest``, then stored."""
    from qmq.cli.push_commands import _add
    from qmq.protocol.push import (
        CONCURRENCY_DEFAULT,
        MAX_RETRIES_DEFAULT,
        TIMEOUT_MS_DEFAULT,
        PushFieldError,
        parse_subscription,
    )

    form = await request.post()
    body: dict[str, Any] = {
        "subject": field(form, "subject"),
        "group": field(form, "group"),
        "url": field(form, "url"),
        "concurrency": _int(form, "concurrency", CONCURRENCY_DEFAULT),
        "rate_per_s": _int(form, "rate_per_s", 0),
        "timeout_ms": _int(form, "timeout_ms", TIMEOUT_MS_DEFAULT),
        "secret": field(form, "secret", required=False),
        "tags": [t for t in field(form, "tags", required=False).split(",") if t.strip()],
        "tag_type": "or",
        "start_from": field(form, "start_from", required=False) or "latest",
        "max_retries": _int(form, "max_retries", MAX_RETRIES_DEFAULT),
    }
    try:
        parse_subscription(body)
    except PushFieldError as exc:
        raise ActionRefused(str(exc)) from None
    await _add(console.meta_server, body)
    return changed(flash(console, f"push {body['subject']} / {body['group']} -> {body['url']}: added"))


async def _push_remove(console: Console, request: web.Request) -> web.StreamResponse:
    form = await request.post()
    params = {"subject": field(form, "subject"), "group": field(form, "group")}
    await _meta(console, "DELETE", "/meta/push", params=params)
    return changed(flash(console, f"push {params['subject']} / {params['group']}: removed"))


async def alarms_page(console: Console, request: web.Request) -> web.StreamResponse:
    return await _listing_page(console, request, "alarms", "alarms", "Alarms")


async def _alarm_add(console: Console, request: web.Request) -> web.StreamResponse:
    form = await request.post()
    for_s = field(form, "for_s", required=False) or "60"
    try:
        for_ms = round(float(for_s) * 1000)
    except ValueError:
        raise ActionRefused(f"for {for_s!r} is not a number of seconds; give one, e.g. 60") from None
    lag_over = _int(form, "lag_over", -1)
    if lag_over < 0:
        raise ActionRefused("backlog over is empty; give the backlog (messages) over which the alarm fires")
    body = {
        "subject": field(form, "subject"),
        "group": field(form, "group"),
        "lag_over": lag_over,
        "for_ms": for_ms,
        "webhook": field(form, "webhook"),
        "secret": field(form, "secret", required=False),
    }
    await _meta(console, "POST", "/meta/alarms", body)
    return changed(flash(console, f"alarm {body['subject']} / {body['group']}: over {lag_over:,}: added"))


async def _alarm_remove(console: Console, request: web.Request) -> web.StreamResponse:
    form = await request.post()
    params = {"subject": field(form, "subject"), "group": field(form, "group")}
    await _meta(console, "DELETE", "/meta/alarms", params=params)
    return changed(flash(console, f"alarm {params['subject']} / {params['group']}: removed"))
