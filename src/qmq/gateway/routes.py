"""The gateway's HTTP routes, each a thin handler: read the request, call the part that owns
the work (``sends``, ``pulls``, ``settle``, ``admin``), answer JSON. Failures are raised and
answered by the error middleware of ``qmq.gateway.server``.

    POST /v1/subjects/{subject}/messages                         send one message or a batch
    POST /v1/subjects/{subject}/groups/{group}/pull              long poll; messages with receipts
    POST /v1/acks                                                ack and nack receipts
    GET  /v1/subjects[?internal=true]                            subjects, message counts, groups
    GET  /v1/subjects/{subject}/groups/{group}/lag               backlog, unacked, consumers
    GET  /v1/subjects/{subject}/groups/{group}/dead-letters      [?limit=N] dead letters
    POST /v1/subjects/{subject}/groups/{group}/dead-letters/resend   {"message_id"} or {"all": true}
    POST /v1/subjects/{subject}/groups/{group}/dead-letters/purge    {"message_id"} or {"all": true}
    GET  /openapi.json                                           the OpenAPI 3.1 document of these
    GET  /health                                                 {"ok": true, ...}
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from qmq.gateway import openapi, sends, settle
from qmq.gateway.admin import DEAD_LETTERS_LIMIT_DEFAULT, DEAD_LETTERS_LIMIT_MAX
from qmq.gateway.errors import bad_request
from qmq.serving.probes import probe_status, with_probe_error

if TYPE_CHECKING:
    from qmq.gateway.server import Gateway

_GROUP = "/v1/subjects/{subject}/groups/{group}"


def _flag(request: web.Request, name: str) -> bool:
    text = request.query.get(name, "false").lower()
    if text not in ("true", "false"):
        raise bad_request("VALUE_INVALID", f"{name}={text!r:.40} must be true or false")
    return text == "true"


def _limit(request: web.Request) -> int:
    text = request.query.get("limit", str(DEAD_LETTERS_LIMIT_DEFAULT))
    if not text.isascii() or not text.isdigit() or not 1 <= int(text) <= DEAD_LETTERS_LIMIT_MAX:
        raise bad_request(
            "VALUE_INVALID", f"limit={text!r:.40} must be a whole number from 1 to {DEAD_LETTERS_LIMIT_MAX}"
        )
    return int(text)


def add_routes(app: web.Application, gateway: Gateway) -> None:
    document = openapi.document()

    async def send(request: web.Request) -> web.Response:
        context = {k: v for k in ("traceparent", "tracestate") if (v := request.headers.get(k)) is not None}
        doc = await sends.send(gateway.producer, request.match_info["subject"], await request.read(), context)
        return web.json_response(doc)

    async def pull(request: web.Request) -> web.Response:
        m = request.match_info
        return web.json_response(await gateway.pulls.pull(m["subject"], m["group"], await request.read()))

    async def acks(request: web.Request) -> web.Response:
        return web.json_response(
            await settle.settle(
                gateway.settler,
                gateway.codec,
                gateway.receipts,
                gateway.acks,
                await request.read(),
                gateway.consumers[0],
            )
        )

    async def subjects(request: web.Request) -> web.Response:
        return web.json_response(await gateway.admin.subjects(_flag(request, "internal")))

    async def lag(request: web.Request) -> web.Response:
        m = request.match_info
        return web.json_response(await gateway.admin.lag(m["subject"], m["group"]))

    async def dead_letters(request: web.Request) -> web.Response:
        m = request.match_info
        return web.json_response(await gateway.admin.dead_letters(m["subject"], m["group"], _limit(request)))

    async def resend_dead(request: web.Request) -> web.Response:
        m = request.match_info
        return web.json_response(
            await gateway.admin.act_on_dead(m["subject"], m["group"], "resend", await request.read())
        )

    async def purge_dead(request: web.Request) -> web.Response:
        m = request.match_info
        return web.json_response(
            await gateway.admin.act_on_dead(m["subject"], m["group"], "purge", await request.read())
        )

    async def openapi_json(_request: web.Request) -> web.Response:
        return web.json_response(document)

    async def health(request: web.Request) -> web.Response:
        # alive once it answers; ready once its clients and services have started (qmq.serving.probes)
        body: dict[str, object] = {
            "ok": True,
            "alive": True,
            "ready": gateway.ready,
            "held": gateway.receipts.held,
            "expired": gateway.receipts.expired,
            "holds_taken_again": gateway.holds.reheld,
        }
        return web.json_response(with_probe_error(request, body), status=probe_status(request, body))

    app.router.add_post("/v1/subjects/{subject}/messages", send)
    app.router.add_post(f"{_GROUP}/pull", pull)
    app.router.add_post("/v1/acks", acks)
    app.router.add_get("/v1/subjects", subjects)
    app.router.add_get(f"{_GROUP}/lag", lag)
    app.router.add_get(f"{_GROUP}/dead-letters", dead_letters)
    app.router.add_post(f"{_GROUP}/dead-letters/resend", resend_dead)
    app.router.add_post(f"{_GROUP}/dead-letters/purge", purge_dead)
    app.router.add_get("/openapi.json", openapi_json)
    app.router.add_get("/health", health)
