"""Message lookup (``/console/messages?id=ID``): where a message went across the cluster —
stored, pulled, acknowledged, retried, dead-lettered — from the brokers' TRACE, as
``qmq trace --meta-server`` asks it (qmq.cli.trace_network)."""

from __future__ import annotations

from aiohttp import web

from qmq.console.base import Console, page


def add_routes(console: Console, app: web.Application) -> None:
    app.router.add_get("/console/messages", page(console, message_page))


async def message_page(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.trace_network import network_trace

    message_id = request.query.get("id", "").strip()
    doc = await network_trace(console.meta_server, message_id) if message_id else None
    return console.render("message.html", title="Message lookup", active="messages", message_id=message_id, doc=doc)
