"""The console's run-time limit actions, each the call of ``qmq limits set|remove`` (the meta
server's ``PUT``/``DELETE /meta/limits``): a group's consume limit on its page, an app's produce
limits on the subjects page; brokers apply a change within a second."""

from __future__ import annotations

import asyncio
import urllib.parse
from typing import Any

from aiohttp import web
from multidict import MultiDictProxy

from qmq.console.base import ActionRefused, Console, changed, field, flash


def rate_field(form: MultiDictProxy[Any], name: str, what: str) -> float:
    """A rate of the form: a number, 0 for no limit."""
    text = field(form, name)
    try:
        rate = float(text)
    except ValueError:
        raise ActionRefused(f"{what} {text!r} is not a number; give one, 0 for no limit") from None
    if rate < 0:
        raise ActionRefused(f"{what} {text!r} is negative; give a number from 0 (no limit) up")
    return rate


async def put_limit(console: Console, body: dict[str, Any], said: str) -> web.StreamResponse:
    """As ``qmq limits set``: ``body`` is one limit row (app, pattern and the three rates)."""
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.common.config import meta_base_url

    await asyncio.to_thread(meta_request, "PUT", f"{meta_base_url(console.meta_server)}/meta/limits", body)
    return changed(flash(console, said))


async def remove_limit(console: Console, request: web.Request) -> web.StreamResponse:
    """As ``qmq limits remove APP PATTERN``."""
    from qmq.cli.limits_commands import _request as meta_request
    from qmq.common.config import meta_base_url

    form = await request.post()
    app, pattern = field(form, "app"), field(form, "pattern")
    query = urllib.parse.urlencode({"app": app, "pattern": pattern})
    await asyncio.to_thread(meta_request, "DELETE", f"{meta_base_url(console.meta_server)}/meta/limits?{query}")
    return changed(flash(console, f"limit removed: app {app}, {pattern}"))
