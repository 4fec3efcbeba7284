"""The meta server process: the HTTP API over the registry, its lifecycle, and ``run_meta``.

Routes:
    GET  /meta/address[?subject=S...]  groups, their states and the routes of the subjects asked for
    POST /meta/register                a broker or delay server reporting itself (also its heartbeat)
    GET  /health                       {"ok": true}
    GET  /metrics                      Prometheus text

The registry and its store are synchronous and run on one dedicated thread, so database
calls never block the event loop and never overlap one another.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import json
import logging
import signal
import socket
import sys
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Final, TypeVar

import uvloop
from aiohttp import web

from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import MetaConfig
from qmq.common.errors import QmqError
from qmq.meta.metrics import CONTENT_TYPE, MetaMetrics
from qmq.meta.payload import (
    REGISTER_BODY_BYTES_MAX,
    REQUEST_LINE_BYTES_MAX,
    PayloadError,
    parse_registration,
    parse_subjects,
)
from qmq.meta.registry import ROLES, GroupView, Registry, RegistryFullError
from qmq.meta.store import MetaStore, MetaStoreError, sqlite_url

log = logging.getLogger(__name__)

T = TypeVar("T")

ADDRESS_PATH: Final = "/meta/address"
REGISTER_PATH: Final = "/meta/register"

# Meta requests are short; shutdown waits this long for those in flight, then cuts them.
SHUTDOWN_GRACE_S: Final = 5.0
# Exit status of run_meta when the server cannot start (distinct from a crash's 1).
EXIT_STARTUP_FAILED: Final = 3
# Heartbeat and refresh are a third of the timeout: a group is marked unavailable only
# after two reports in a row went missing, and clients learn of it within one more third.
_HEARTBEATS_PER_TIMEOUT: Final = 3
_INTERVAL_MS_MIN: Final = 10


class MetaStartupError(QmqError):
    """The meta server cannot start; the message names the cause and what to do."""


def _error(status: int, text: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": text}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


def _group_json(g: GroupView) -> dict[str, str]:
    return {"group": g.group, "address": g.address, "http": g.http, "state": g.state, "role": "master"}


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class MetaServer:
    """One meta server: ``await start()`` binds and serves, ``await stop()`` shuts it down."""

    def __init__(self, config: MetaConfig, clock: Clock = SYSTEM_CLOCK) -> None:
        self.config = config
        self.clock = clock
        self.metrics = MetaMetrics()
        self.port = 0
        self.url = ""
        self.meta_server_url = ""
        self.interval_ms = max(_INTERVAL_MS_MIN, config.heartbeat_timeout_ms // _HEARTBEATS_PER_TIMEOUT)
        self._executor: ThreadPoolExecutor | None = None
        self._store: MetaStore | None = None
        self._registry: Registry | None = None
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        """Open the store and listen on host:port; MetaStartupError when either cannot be done."""
        if self._executor is not None:
            raise RuntimeError("MetaServer.start() was called twice")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qmq-meta-store")
        try:
            await self._call(self._open)
            await self._listen()
        except MetaStoreError as exc:
            await self.stop()
            raise MetaStartupError(str(exc)) from None
        except BaseException:
            await self.stop()
            raise

    def _open(self) -> None:
        url = self.config.db_url or sqlite_url(self.config.data_dir)
        self._store = MetaStore(url)
        try:
            self._registry = Registry(
                self._store,
                self.clock,
                heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
                route_groups=self.config.route_groups,
            )
        except BaseException:
            self._store.close()
            self._store = None
            raise

    async def _listen(self) -> None:
        app = web.Application(middlewares=[self._observe], client_max_size=REGISTER_BODY_BYTES_MAX)
        app.router.add_get(ADDRESS_PATH, self._address)
        app.router.add_post(REGISTER_PATH, self._register)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S, max_line_size=REQUEST_LINE_BYTES_MAX
        )
        await self._runner.setup()
        host, port = self.config.host, self.config.port
        try:
            await web.TCPSite(self._runner, host, port).start()
        except OSError as exc:
            raise MetaStartupError(_bind_problem(host, port, exc)) from None
        self.port = int(self._runner.addresses[0][1])
        self.url = f"http://{_url_host(host)}:{self.port}"
        self.meta_server_url = self.url + ADDRESS_PATH

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish (bounded), then close the store."""
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            store, self._store, self._registry = self._store, None, None
            if store is not None:
                await asyncio.get_running_loop().run_in_executor(executor, store.close)
            # The one thread is idle now (the close above was its last task), so this is instant.
            executor.shutdown(wait=True)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise MetaStoreError("the meta server is stopped")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def _registry_now(self) -> Registry:
        if self._registry is None:
            raise MetaStoreError("the meta server is stopped")
        return self._registry

    @web.middleware
    async def _observe(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        """Count every answer; give every error a JSON body, including aiohttp's own 404/405/413."""
        resource = request.match_info.route.resource
        path = resource.canonical if resource is not None else "other"
        try:
            response = await handler(request)
        except web.HTTPException as exc:
            if exc.status < 400:
                self.metrics.http_requests.labels(path=path, status=str(exc.status)).inc()
                raise
            response = _error(exc.status, f"{request.method} {request.path}: {exc.reason}")
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except (MetaStoreError, RegistryFullError) as exc:
            log.warning("%s %s: %s", request.method, request.path, exc)
            response = _error(503, str(exc))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = _error(
                500, f"{request.method} {request.path}: internal error of the meta server (see its log)"
            )
        self.metrics.http_requests.labels(path=path, status=str(response.status)).inc()
        return response

    async def _address(self, request: web.Request) -> web.Response:
        try:
            subjects = parse_subjects(request.query.getall("subject", []))
        except PayloadError as exc:
            return _error(400, str(exc), exc.field)
        body = await self._call(self._address_view, subjects)
        return web.json_response(body)

    def _address_view(self, subjects: list[str]) -> dict[str, Any]:
        registry = self._registry_now()
        groups = {role: [_group_json(g) for g in registry.groups(role)] for role in ROLES}
        return {
            "broker_groups": groups["broker"],
            "delay_groups": groups["delay"],
            "routes": registry.routes(subjects) if subjects else {},
            "refresh_ms": self.interval_ms,
        }

    async def _register(self, request: web.Request) -> web.Response:
        raw = await request.read()
        try:
            body = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            return _error(400, f"the register body is not JSON ({exc}); send a JSON object", "body")
        try:
            reg = parse_registration(body)
        except PayloadError as exc:
            return _error(400, str(exc), exc.field)
        is_new = await self._call(lambda: self._registry_now().register(reg))
        if is_new:
            log.info(
                "registered %s %s (%s) of group %r, pid %d",
                reg.role,
                reg.address,
                reg.role_in_group,
                reg.group,
                reg.pid,
            )
            self.metrics.registrations.labels(role=reg.role).inc()
        else:
            self.metrics.heartbeats.labels(role=reg.role).inc()
        return web.json_response({"ok": True, "heartbeat_ms": self.interval_ms})

    async def _health(self, _request: web.Request) -> web.Response:
        return web.json_response({"ok": True})

    async def _metrics(self, _request: web.Request) -> web.Response:
        counts = await self._call(lambda: self._registry_now().counts())
        return web.Response(body=self.metrics.render(counts), headers={"Content-Type": CONTENT_TYPE})


def _bind_problem(host: str, port: int, exc: OSError) -> str:
    where = f"{host}:{port}"
    if exc.errno == errno.EADDRINUSE:
        return (
            f"cannot listen on {where}: the port is in use; "
            "stop what uses it or choose another port (0 picks a free one)"
        )
    if exc.errno == errno.EACCES:
        return f"cannot listen on {where}: permission denied; choose a port above 1023"
    if exc.errno == errno.EADDRNOTAVAIL or isinstance(exc, socket.gaierror):
        return (
            f"cannot listen on {where}: {host!r} is not an address of this machine; "
            "set host to one (e.g. 127.0.0.1)"
        )
    return f"cannot listen on {where}: {exc.strerror or exc}"


def run_meta(config: MetaConfig) -> int:
    """Run a meta server until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves: ``qmq ready role=meta meta_server=URL http=URL``.
    """
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(config))


async def _serve(config: MetaConfig) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = (signal.SIGTERM, signal.SIGINT)
    for sig in signals:
        loop.add_signal_handler(sig, stop.set)
    try:
        server = MetaServer(config)
        try:
            await server.start()
        except MetaStartupError as exc:
            print(f"qmq meta: cannot start: {exc}", file=sys.stderr, flush=True)
            return EXIT_STARTUP_FAILED
        try:
            print(f"qmq ready role=meta meta_server={server.meta_server_url} http={server.url}", flush=True)
            await stop.wait()
            log.info("meta server on %s shutting down", server.url)
        finally:
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0
