"""The delay page (``/console/delay``): what every delay group holds, pending per time bucket
(DELAY_STATS, as ``qmq delay-stats`` asks it), and a subject's messages due within the next
hour (DELAY_LIST through the SDK, as ``qmq delay-list SUBJECT --to 1h`` reads them)."""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from qmq.common.errors import QmqError
from qmq.console.base import Console, page

_BUCKETS_ASKED = 200  # soonest buckets asked of each delay group
_HOUR_MS = 3_600_000
_DUE_LISTED_MAX = 500  # a subject's messages due within the hour, listed at most


def add_routes(console: Console, app: web.Application) -> None:
    app.router.add_get("/console/delay", page(console, delay_page))


async def delay_page(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.delay_commands import ask_every_delay_group

    answers = await ask_every_delay_group(console.meta_server, {"buckets_max": _BUCKETS_ASKED})
    now_ms = int(time.time() * 1000)
    groups: list[dict[str, Any]] = []
    errors: dict[str, str] = {}
    for name, answer in sorted(answers.items()):
        if isinstance(answer, QmqError):
            errors[name] = str(answer)
            continue
        buckets = answer.get("buckets", [])
        due = sum(int(b["pending"]) for b in buckets if int(b["start_ms"]) < now_ms + _HOUR_MS)
        chart = {
            "t": [int(b["start_ms"]) / 1000 for b in buckets],
            "labels": ["pending"],
            "series": [[int(b["pending"]) for b in buckets]],
        }
        groups.append({"name": name, **answer, "due_next_hour": due, "chart": chart})
    subject = request.query.get("subject", "").strip()
    due_list = await _due_within_the_hour(console, subject, now_ms) if subject else None
    return console.render(
        "delay.html",
        title="Delay",
        active="delay",
        groups=groups,
        errors=errors,
        hour_end_ms=now_ms + _HOUR_MS,
        subject=subject,
        due_list=due_list,
        due_listed_max=_DUE_LISTED_MAX,
    )


async def _due_within_the_hour(console: Console, subject: str, now_ms: int) -> list[dict[str, Any]]:
    from qmq.aio import Producer
    from qmq.cli.auth_commands import ACTING_FOR, cli_app_code

    acting = ACTING_FOR.get()
    out: list[dict[str, Any]] = []
    async with Producer(
        app_code=cli_app_code("qmq-console"),
        secret=acting[1] if acting else None,
        meta_server=console.meta_server,
        send_timeout_ms=10_000,
    ) as producer:
        pending = producer.delay_pending(subject, now_ms / 1000, (now_ms + _HOUR_MS) / 1000)
        try:
            async for p in pending:
                out.append({"message_id": p.message_id, "due_ms": p.due_ms, "copy": p.copy, "group": p.group})
                if len(out) >= _DUE_LISTED_MAX:
                    break
        finally:
            await pending.aclose()
    return out
