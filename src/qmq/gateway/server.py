"""The gateway process: an aiohttp server whose routes call the asyncio SDK, its background
services, its lifecycle, and ``run_gateway``.

Start-up: the SDK's producer and consumer (they ask the meta server for the brokers), then
the HTTP server, then the background services; the ready line last. Shutdown is the other
way round: services, then the HTTP server (requests in flight get ``shutdown_grace_ms``),
then the consumer (its pending acks are sent) and the producer.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Final

import uvloop
from aiohttp import web
from prometheus_client import CollectorRegistry

from qmq.aio import Consumer, Producer
from qmq.auth.exposure import check_exposure
from qmq.auth.file import load_auth_file
from qmq.auth.http import basic_authorization
from qmq.auth.permissions import Action
from qmq.client.options import secret_of
from qmq.common.config import GatewayConfig
from qmq.common.errors import ConfigError, QmqError
from qmq.gateway import routes
from qmq.gateway.admin import Admin
from qmq.gateway.errors import ApiError, api_error_of
from qmq.gateway.holds import HoldKeeper
from qmq.gateway.payload import REQUEST_BYTES_MAX
from qmq.gateway.pulls import Pulls
from qmq.gateway.receipts import Issued, ReceiptCodec, receipt_key
from qmq.gateway.services import BackgroundService, background_services
from qmq.gateway.settle import AckRecorder, Settler
from qmq.gateway.transforms import Transforms
from qmq.serving.http_auth import HttpAuth, Need
from qmq.serving.runner import tune_gc
from qmq.serving.tls import outgoing_context, server_context

log = logging.getLogger(__name__)

# Exit status when the gateway cannot start (as every role: distinct from a crash's 1).
EXIT_STARTUP_FAILED: Final = 3

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class GatewayStartupError(Exception):
    """The gateway cannot start; the text says why and what to do."""


class Gateway:
    """What the routes and services of one gateway share: its config and its SDK clients."""

    def __init__(self, config: GatewayConfig) -> None:
        if not config.meta_server:
            raise ConfigError("the gateway needs --meta-server URL (as printed by `qmq ready`)")
        self.config = config
        # a few consumer ids per gateway process (the broker keeps a pull log for each), so several
        # pulls of one group run at once
        prefix = f"gateway-{socket.gethostname()[:40]}-{os.getpid()}"
        # TLS and the gateway's own app (its secret from $QMQ_SECRET) toward the meta server and brokers
        self.tls_out = outgoing_context(config)
        self.producer = Producer(app_code=config.app_code, meta_server=config.meta_server, ssl=self.tls_out)
        self.ready = False  # GET /health?probe=ready: set once every service has started
        # acks are sent by flushes only, so POST /v1/acks is answered once a flush delivered them
        ids = [f"{prefix}-{i}" for i in range(config.pull_consumers)]
        self.consumers = [
            Consumer(
                app_code=config.app_code,
                meta_server=config.meta_server,
                consumer_id=consumer_id,
                acks_with_pulls=False,
                ssl=self.tls_out,
            )
            for consumer_id in ids
        ]
        key, source = receipt_key(config.receipt_key_file, secret_of(None))
        if not source:
            log.warning(
                "no receipt key ($QMQ_RECEIPT_KEY, receipt_key_file or an app secret): only this gateway settles "
                "the receipts it hands out; give every gateway of the cluster the same key (docs/gateway.md)"
            )
        self.codec = ReceiptCodec(key)
        self.receipts = Issued(config.receipts_max)
        self.admin = Admin(config.meta_server, config.app_code, self.tls_out)
        self.settler = Settler(self.admin.meta, self.admin.pool)
        self.receipts.give_back_fn = self.settler.give_back
        self.holds = HoldKeeper(self.settler, self.receipts)
        self.receipts.before_sweep = self.holds.check
        self.transforms = Transforms()
        secret = secret_of(None)
        authorization = basic_authorization(config.app_code, secret) if secret else None
        self.transforms.poll(config.meta_server, authorization, self.tls_out)
        self.pulls = Pulls(
            self.consumers,
            ids,
            self.receipts,
            self.codec,
            self.settler,
            config.ack_timeout_ms,
            config.pull_groups_max,
            self.transforms,
        )
        self.acks = AckRecorder(self.consumers)


@web.middleware
async def _errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every failure as ``{"error": {"code", "message"}}``: never a traceback, never HTML."""
    try:
        return await handler(request)
    except ApiError as exc:
        return web.json_response(exc.body(), status=exc.status)
    except QmqError as exc:
        err = api_error_of(exc)
        return web.json_response(err.body(), status=err.status)
    except web.HTTPException as exc:
        code = {
            404: "NOT_FOUND",
            405: "METHOD_NOT_ALLOWED",
            413: "BODY_TOO_LARGE",
        }.get(exc.status, "HTTP_ERROR")
        text = {
            404: f"no route {request.method} {request.path}; GET /openapi.json lists the routes",
            405: f"{request.path} does not take {request.method}; GET /openapi.json lists the routes",
            413: f"the body is larger than the gateway takes ({REQUEST_BYTES_MAX} bytes); send smaller batches",
        }.get(exc.status, exc.reason)
        return web.json_response(ApiError(exc.status, code, text).body(), status=exc.status)
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("%s %s failed", request.method, request.path)
        err = ApiError(500, "INTERNAL_ERROR", "the gateway failed this request; its log says why")
        return web.json_response(err.body(), status=500)


class GatewayServer:
    """One gateway: ``await start()``, ``url``, ``await stop()``."""

    def __init__(self, config: GatewayConfig) -> None:
        self.config = config
        self.gateway = Gateway(config)
        self.services: list[BackgroundService] = background_services(self.gateway)
        self._started: list[BackgroundService] = []
        self._runner: web.AppRunner | None = None
        self.port = 0
        self.tls = server_context(config)
        warning = check_exposure("gateway", config.host, config.auth_file, config.insecure)
        if warning is not None:
            log.warning("%s", warning)
            print(f"qmq gateway: {warning}", file=sys.stderr, flush=True)
        self.http_auth: HttpAuth | None = None
        if config.auth_file:
            self.http_auth = HttpAuth(
                load_auth_file(Path(config.auth_file)), _needs, CollectorRegistry(), render=_api_refusal
            )

    @property
    def url(self) -> str:
        host = f"[{self.config.host}]" if ":" in self.config.host else self.config.host
        return f"{'https' if self.tls is not None else 'http'}://{host}:{self.port}"

    def app(self) -> web.Application:
        middlewares = [_errors] if self.http_auth is None else [_errors, self.http_auth.middleware]
        app = web.Application(middlewares=middlewares, client_max_size=REQUEST_BYTES_MAX)
        routes.add_routes(app, self.gateway)
        return app

    async def start(self) -> None:
        g = self.gateway
        try:
            await g.producer.start()
            for consumer in g.consumers:
                await consumer.start()
            await g.admin.start()
        except QmqError as exc:
            raise GatewayStartupError(f"cannot reach the meta server {self.config.meta_server}: {exc}") from None
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=self.config.shutdown_grace_ms / 1000)
        await self._runner.setup()
        sock = socket.socket(socket.AF_INET6 if ":" in self.config.host else socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.config.host, self.config.port))
        except OSError as exc:
            sock.close()
            raise GatewayStartupError(_bind_problem(self.config.host, self.config.port, exc)) from None
        self.port = int(sock.getsockname()[1])
        await web.SockSite(self._runner, sock, ssl_context=self.tls).start()
        for service in self.services:
            await service.start()
            self._started.append(service)
        g.ready = True

    def reload_auth(self) -> None:
        """Read the auth file again (SIGHUP); a wrong new file is logged and the old one kept."""
        if self.http_auth is not None:
            self.http_auth.reload_file(self.config.auth_file)

    def ready_line(self) -> str:
        return f"qmq ready role=gateway gateway={self.url} meta_server={self.config.meta_server}"

    async def stop(self) -> None:
        self.gateway.ready = False
        while self._started:
            service = self._started.pop()
            try:
                await service.stop()
            except Exception:  # one service failing to stop must not keep the rest running
                log.exception("stopping %r failed", service)
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        await self.gateway.admin.stop()
        for consumer in self.gateway.consumers:
            await consumer.close()
        await self.gateway.producer.close()


def _needs(request: web.Request) -> Need:
    """What a gateway request needs its app to be allowed (with an auth file): a send, produce
    on its subject; /health nobody; any other route an admin, until it says otherwise."""
    if request.path == "/health":
        return "open"
    subject = request.match_info.get("subject")
    if request.method == "POST" and subject is not None and request.path.endswith("/messages"):
        return (Action.PRODUCE, subject, None)
    return Action.ADMIN


def _api_refusal(status: int, body: dict[str, Any]) -> web.Response:
    """A refusal of the auth check in the gateway's error format."""
    code = "UNAUTHENTICATED" if status == 401 else "FORBIDDEN"
    error = {"code": code, "message": body["error"], **{k: v for k, v in body.items() if k != "error"}}
    return web.json_response({"error": error}, status=status)


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return f"cannot listen on {where}: the port is in use; choose another with --port (0 picks a free one)"
    if exc.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied; choose a port above 1023"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {where}: {host!r} is not an address of this machine; use --host 127.0.0.1"
    return f"cannot listen on {where}: {exc.strerror or exc}"


def run_gateway(config: GatewayConfig) -> int:
    """Run a gateway until SIGTERM or SIGINT; 0 after a clean stop, 3 when it cannot start.

    Prints one line once it serves: ``qmq ready role=gateway gateway=URL meta_server=URL``.
    """
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config))


async def _serve(config: GatewayConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        try:
            server = GatewayServer(config)
        except QmqError as exc:
            print(f"qmq gateway: cannot start: {exc}", file=sys.stderr, flush=True)
            return EXIT_STARTUP_FAILED
        try:
            try:
                await server.start()
            except (GatewayStartupError, QmqError, OSError) as exc:
                print(f"qmq gateway: cannot start: {exc}", file=sys.stderr, flush=True)
                return EXIT_STARTUP_FAILED
            if server.http_auth is not None:
                loop.add_signal_handler(signal.SIGHUP, server.reload_auth)
            tune_gc()  # as the other roles: receipts held by the thousand stay out of full passes
            print(server.ready_line(), flush=True)
            await stop.wait()
            log.info("gateway on %s shutting down", server.url)
        finally:
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0
