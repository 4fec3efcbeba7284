"""A consumer group's page (``/console/subjects/{subject}/groups/{group}``): its lag over the
last hour, consumers, pause state, filter, limits and push subscription, and the actions on
it — pause, resume, reset offset, filter, a consume limit — each the call of its ``qmq``
command (``qmq group``, ``qmq reset-offset``, ``qmq limits set``)."""

from __future__ import annotations

import asyncio
import urllib.parse
from fnmatch import fnmatchcase
from typing import Any

from aiohttp import web

from qmq.console.base import ActionRefused, Console, action, changed, field, flash, page
from qmq.console.limit_actions import put_limit, rate_field, remove_limit

_GROUP_PATH = "/console/subjects/{subject}/groups/{group}"


def add_routes(console: Console, app: web.Application) -> None:
    r = app.router
    r.add_get(_GROUP_PATH, page(console, group_page))
    for name, fn in (
        ("pause", _pause),
        ("resume", _resume),
        ("reset", _reset),
        ("filter", _filter),
        ("transform", _transform),
        ("limit", _limit),
        ("unlimit", remove_limit),
    ):
        r.add_post(f"{_GROUP_PATH}/{name}", action(console, fn))


def _names(request: web.Request) -> tuple[str, str]:
    return request.match_info["subject"], request.match_info["group"]


async def _meta(console: Console, method: str, path: str, body: object = None) -> Any:
    """One meta server call as ``qmq`` makes it (qmq.cli.push_commands)."""
    from qmq.cli.push_commands import _base, _meta_request

    return await _meta_request(method, _base(console.meta_server) + path, body)


async def group_state(console: Console, subject: str, group: str) -> dict[str, Any]:
    """What the page shows of a group, read as ``qmq group list`` and ``qmq limits list`` do."""
    from qmq.cli.control_commands import _group_doc
    from qmq.cli.group_commands import _dead_letters

    controls, limits, push, dead = await asyncio.gather(
        _meta(console, "GET", "/meta/controls"),
        _meta(console, "GET", "/meta/limits"),
        _meta(console, "GET", "/meta/push"),
        _dead_letters(console.meta_server, subject, group, 1, lambda _letter: None),
    )
    paused = [subject, group] in controls.get("paused", [])
    doc = await _group_doc(console.meta_server, subject, group, paused)
    if doc["consumers"]:  # known to the brokers: the meta server lists them with since when
        query = urllib.parse.urlencode({"subject": subject, "group": group})
        listed = await _meta(console, "GET", f"/meta/groups/consumers?{query}")
        since = {(c["consumer_id"], c["broker_group"]): c.get("since_ms") for c in listed["consumers"]}
        for c in doc["consumers"]:
            c["since_ms"] = since.get((c["consumer_id"], c["broker_group"]))
        doc["unreachable"] = listed.get("unreachable", [])
    pattern = f"{subject}:{group}"
    return {
        **doc,
        "dead_letters": dead,
        "filter": next((f[2] for f in controls.get("filters", []) if f[:2] == [subject, group]), None),
        "transform": next((t[2] for t in controls.get("transforms", []) if t[:2] == [subject, group]), None),
        "limits": [
            row
            for row in limits.get("limits", [])
            if row.get("consume_msgs_per_s") and fnmatchcase(pattern, str(row["pattern"]))
        ],
        "push": next(
            (s for s in push.get("subscriptions", []) if (s["subject"], s["group"]) == (subject, group)), None
        ),
    }


async def group_page(console: Console, request: web.Request) -> web.StreamResponse:
    subject, group = _names(request)
    state = await group_state(console, subject, group)
    context: dict[str, Any] = {"subject": subject, "group": group, "state": state, "path": request.path}
    if request.query.get("part") == "state":
        return console.render("group_state.html", **context)
    chart = console.sampler.history.chart([("lag", ("lag", subject, group))])
    return console.render("group.html", title=f"{subject} / {group}", active="subjects", chart=chart, **context)


async def _pause(console: Console, request: web.Request) -> web.StreamResponse:
    return await _set(console, request, "pause")


async def _resume(console: Console, request: web.Request) -> web.StreamResponse:
    return await _set(console, request, "resume")


async def _set(console: Console, request: web.Request, what: str) -> web.StreamResponse:
    from qmq.cli.control_commands import _set as set_control

    subject, group = _names(request)
    answer = await asyncio.to_thread(set_control, subject, group, console.meta_server, what)
    if what == "pause":
        text = f"paused {subject} for group {group}" + (" (it was paused already)" if answer.get("was") else "")
    else:
        text = f"resumed {subject} for group {group}" + ("" if answer.get("was") else " (it was not paused)")
    return changed(flash(console, text + "; brokers apply it within a second"))


async def _reset(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.group_commands import _answers, _point
    from qmq.protocol.codes import RequestCode

    subject, group = _names(request)
    form = await request.post()
    to = field(form, "to")
    header = {"subject": subject, "group": group, "to": _point(to)}
    answers = await asyncio.to_thread(_answers, console.meta_server, RequestCode.RESET_OFFSET, header)
    moved = "; ".join(f"{name}: {h['before']:,} → {h['pull_offset']:,}" for name, h in sorted(answers.items()))
    return changed(flash(console, f"reset {subject} / {group} to {to}: pull offset {moved}"))


async def _filter(console: Console, request: web.Request) -> web.StreamResponse:
    return await _expression(console, request, "filter")


async def _transform(console: Console, request: web.Request) -> web.StreamResponse:
    return await _expression(console, request, "transform")


async def _expression(console: Console, request: web.Request, kind: str) -> web.StreamResponse:
    """Set or clear the group's filter or transform, as ``qmq group filter|transform`` does."""
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.common.config import meta_base_url

    subject, group = _names(request)
    form = await request.post()
    expr = field(form, "expr", required=False) or None
    if form.get("clear"):
        expr = None
    elif expr is None:
        raise ActionRefused(f"the {kind} expression is empty; write one, or press Clear to remove the {kind}")
    url = f"{meta_base_url(console.meta_server)}/meta/controls/{kind}"
    await asyncio.to_thread(meta_request, "POST", url, {"subject": subject, "group": group, "expr": expr})
    applied = "brokers apply it" if kind == "filter" else "gateways apply it"
    text = f"{kind} set: {expr}" if expr is not None else f"{kind} cleared"
    return changed(flash(console, f"{text}; {applied} within a second"))


async def _limit(console: Console, request: web.Request) -> web.StreamResponse:
    subject, group = _names(request)
    form = await request.post()
    app = field(form, "app")
    rate = rate_field(form, "consume_msgs_per_s", "consume msgs/s")
    body = {
        "app": app,
        "pattern": f"{subject}:{group}",
        "produce_msgs_per_s": 0.0,
        "produce_bytes_per_s": 0.0,
        "consume_msgs_per_s": rate,
    }
    return await put_limit(console, body, f"limit set: app {app} consumes {subject} / {group} at most {rate:g} msgs/s")
