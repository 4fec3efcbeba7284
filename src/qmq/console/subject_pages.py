"""The subjects page (``/console/subjects``): every subject recorded or held by the brokers,
with owner, messages, consumer groups, rates in and out now and charted over the last hour;
create a subject record, delete one — the calls of ``qmq subject create|list|delete``."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

from aiohttp import web

from qmq.console.base import ActionRefused, Console, action, changed, field, flash, page
from qmq.console.limit_actions import put_limit, rate_field, remove_limit

# subjects charted (the busiest by messages held); the table lists them all
_CHARTED_MAX = 8


def add_routes(console: Console, app: web.Application) -> None:
    app.router.add_get("/console/subjects", page(console, subjects_page))
    app.router.add_post("/console/subjects/create", action(console, _create))
    app.router.add_post("/console/subjects/delete", action(console, _delete))
    app.router.add_post("/console/subjects/limit", action(console, _produce_limit))
    app.router.add_post("/console/subjects/unlimit", action(console, remove_limit))


async def subjects_page(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.cli.subject_commands import held_by_brokers
    from qmq.common.config import meta_base_url

    base = meta_base_url(console.meta_server)
    answer, held, limits = await asyncio.gather(
        asyncio.to_thread(meta_request, "GET", f"{base}/meta/subjects"),
        held_by_brokers(console.meta_server),
        asyncio.to_thread(meta_request, "GET", f"{base}/meta/limits"),
    )
    records = {r["subject"]: r for r in answer["subjects"]}
    latest = console.sampler.latest or {}
    rates = {s["subject"]: s for s in latest.get("subjects", [])}
    rows: list[dict[str, Any]] = []
    for name in sorted(set(records) | set(held)):
        record = records.get(name, {})
        rows.append(
            {
                "subject": name,
                "owner": record.get("owner"),
                "description": record.get("description"),
                "recorded": name in records,
                **held.get(name, {"messages": 0, "consumer_groups": []}),
                "in_per_s": rates.get(name, {}).get("in_per_s"),
                "out_per_s": rates.get(name, {}).get("out_per_s"),
            }
        )
    charted = [r["subject"] for r in sorted(rows, key=lambda r: -int(r["messages"]))[:_CHARTED_MAX]]
    history = console.sampler.history
    return console.render(
        "subjects.html",
        title="Subjects",
        active="subjects",
        rows=rows,
        produce_limits=[
            row for row in limits.get("limits", []) if row.get("produce_msgs_per_s") or row.get("produce_bytes_per_s")
        ],
        chart_in=history.chart([(s, ("in", s)) for s in charted]),
        chart_out=history.chart([(s, ("out", s)) for s in charted]),
    )


async def _create(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.common.config import meta_base_url

    form = await request.post()
    body = {
        "subject": field(form, "subject"),
        "owner": field(form, "owner"),
        "description": field(form, "description", required=False),
    }
    await asyncio.to_thread(meta_request, "POST", f"{meta_base_url(console.meta_server)}/meta/subjects", body)
    return changed(flash(console, f"created: {body['subject']} (owner {body['owner']})"))


async def _delete(console: Console, request: web.Request) -> web.StreamResponse:
    """As ``qmq subject delete [--force]``: the meta server refuses while something of the
    subject remains (a group's backlog, messages no group pulled, pending delay messages)."""
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.common.config import meta_base_url

    form = await request.post()
    subject = field(form, "subject")
    force = bool(form.get("force"))
    query = urllib.parse.urlencode({"subject": subject, "force": "true" if force else "false"})
    await asyncio.to_thread(meta_request, "DELETE", f"{meta_base_url(console.meta_server)}/meta/subjects?{query}")
    return changed(flash(console, f"deleted: {subject}{' (forced)' if force else ''}"))


async def _produce_limit(console: Console, request: web.Request) -> web.StreamResponse:
    """As ``qmq limits set APP PATTERN --produce-msgs-per-s N --produce-bytes-per-s N``."""
    form = await request.post()
    app, pattern = field(form, "app"), field(form, "pattern")
    msgs = rate_field(form, "produce_msgs_per_s", "produce msgs/s")
    nbytes = rate_field(form, "produce_bytes_per_s", "produce bytes/s")
    if not msgs and not nbytes:
        raise ActionRefused("give a produce rate in msgs/s or bytes/s (or both); remove a limit with its Remove button")
    body = {
        "app": app,
        "pattern": pattern,
        "produce_msgs_per_s": msgs,
        "produce_bytes_per_s": nbytes,
        "consume_msgs_per_s": 0.0,
    }
    said = f"limit set: app {app} produces to {pattern} at most {msgs:g} msgs/s and {nbytes:g} bytes/s (0: no limit)"
    return await put_limit(console, body, said)
