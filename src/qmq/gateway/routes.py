"""The gateway's HTTP routes, each a thin handler: read the request, call the part that owns
the work (``sends``, ``pulls``, ``admin``), answer JSON. Failures are raised and answered by
the error middleware of ``qmq.gateway.server``.

    POST /v1/subjects/{subject}/messages                       send one message or a batch
    GET  /health                                               {"ok": true}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from qmq.gateway import sends

if TYPE_CHECKING:
    from qmq.gateway.server import Gateway


def add_routes(app: web.Application, gateway: Gateway) -> None:
    async def send(request: web.Request) -> web.Response:
        doc = await sends.send(gateway.producer, request.match_info["subject"], await request.read())
        return web.json_response(doc)

    async def health(_request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    app.router.add_post("/v1/subjects/{subject}/messages", send)
    app.router.add_get("/health", health)
