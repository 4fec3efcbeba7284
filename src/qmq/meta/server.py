"""The meta server process: the HTTP API over the registry, its lifecycle, and ``run_meta``.

Routes:
    /meta/address, /meta/register, /meta/cluster, /meta/promote: routes, registration and
                                       heartbeats, the cluster view, promotion (qmq.meta.cluster_http)
    /meta/drain, /meta/undrain, /meta/routes, /meta/remove-group, /meta/history: cluster
                                       operations (qmq.meta.operations_http)
    /meta/push...                      push subscriptions and their leases (qmq.meta.push_http)
    /meta/alarms                       backlog alarms (qmq.meta.alarms_http)
    /console/...                       the web console (qmq.console), admin apps only
    GET  /health                       {"ok": true}
    GET  /metrics                      Prometheus text

The registry and its store are synchronous and run on one dedicated thread, so database
calls never block the event loop and never overlap one another. A periodic tick on that
thread takes or renews the leader lease and, on the leader, promotes slaves of groups whose
master went silent.
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
from pathlib import Path
from typing import Any, Final, Literal, TypeVar

import uvloop
from aiohttp import web

from qmq.auth.exposure import check_exposure
from qmq.auth.file import load_auth_file
from qmq.auth.permissions import Action
from qmq.common.clock import SYSTEM_CLOCK, Clock
from qmq.common.config import MetaConfig
from qmq.common.errors import ConfigError, QmqError
from qmq.console import CONSOLE_PATH, ConsoleApi
from qmq.meta.alarms import AlarmStore, Notice
from qmq.meta.alarms_http import AlarmApi
from qmq.meta.broker_reads import BrokerReads, GroupsApi, credentials_of
from qmq.meta.cluster_http import (
    ADDRESS_PATH,
    PROMOTE_PATH,
    REGISTER_PATH,
    ClusterApi,
    ClusterParts,
    error_response,
)
from qmq.meta.controls import ControlsApi, ControlsStore
from qmq.meta.leader import LeaderLease, default_owner
from qmq.meta.limits import LimitsApi, LimitsStore
from qmq.meta.metrics import CONTENT_TYPE, MetaMetrics
from qmq.meta.operations import Operations
from qmq.meta.operations_http import OperationsApi
from qmq.meta.payload import (
    REGISTER_BODY_BYTES_MAX,
    REQUEST_LINE_BYTES_MAX,
    PayloadError,
)
from qmq.meta.push_http import LEASE_PATH as PUSH_LEASE_PATH
from qmq.meta.push_http import RELEASE_PATH as PUSH_RELEASE_PATH
from qmq.meta.push_http import PushApi
from qmq.meta.push_store import PushStore
from qmq.meta.registry import (
    Promotion,
    Registry,
    RegistryFullError,
)
from qmq.meta.store import MetaStore, MetaStoreError, sqlite_url
from qmq.meta.subjects import SubjectsApi, SubjectsStore
from qmq.serving.http_auth import HttpAuth, Need
from qmq.serving.probes import probe_status, with_probe_error
from qmq.serving.tls import outgoing_context, server_context

log = logging.getLogger(__name__)

T = TypeVar("T")


# Meta requests are short; shutdown waits this long for those in flight, then cuts them.
SHUTDOWN_GRACE_S: Final = 5.0
# Exit status of run_meta when the server cannot start (distinct from a crash's 1).
EXIT_STARTUP_FAILED: Final = 3
# Heartbeat and refresh are a third of the timeout: a group is marked unavailable only
# after two reports in a row went missing, and clients learn of it within one more third.
_HEARTBEATS_PER_TIMEOUT: Final = 3
_INTERVAL_MS_MIN: Final = 10
# The leader tick: promotion is checked four times per heartbeat timeout, and the lease is
# renewed three times per lease, whichever is more often; at most every 10 s.
_TICKS_PER_TIMEOUT: Final = 4
_TICKS_PER_LEASE: Final = 3
_TICK_MS_MAX: Final = 10_000


class MetaStartupError(QmqError):
    """The meta server cannot start; the message names the cause and what to do."""


def _running(part: T | None) -> T:
    """A part of the meta server that exists while it runs (its stores, its lease)."""
    if part is None:
        raise MetaStoreError("the meta server is stopped")
    return part


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


class MetaServer:
    """One meta server: ``await start()`` binds and serves, ``await stop()`` shuts it down."""

    def __init__(self, config: MetaConfig, clock: Clock = SYSTEM_CLOCK, *, autotick: bool = True) -> None:
        """``autotick=False`` leaves the leader tick to calls of ``tick()`` (tests drive it by hand)."""
        self.config = config
        self.autotick = autotick
        self.clock = clock
        self.metrics = MetaMetrics()
        self.port = 0
        self.url = ""
        self.meta_server_url = ""
        self.interval_ms = max(_INTERVAL_MS_MIN, config.heartbeat_timeout_ms // _HEARTBEATS_PER_TIMEOUT)
        self.tick_ms = max(
            _INTERVAL_MS_MIN,
            min(
                config.heartbeat_timeout_ms // _TICKS_PER_TIMEOUT,
                config.leader_lease_ms // _TICKS_PER_LEASE,
                _TICK_MS_MAX,
            ),
        )
        self.owner = default_owner()
        self.http_auth: HttpAuth | None = None  # with an auth file (config.auth_file)
        self._executor: ThreadPoolExecutor | None = None
        self._store: MetaStore | None = None
        self._registry: Registry | None = None
        self._operations: Operations | None = None
        self._push: PushStore | None = None
        self._alarms: AlarmStore | None = None
        self._alarm_api = AlarmApi(self._call, self._alarms_now, clock)
        self._alarm_notices: list[Notice] = []  # due from the last tick, sent by tick()
        self._limits: LimitsStore | None = None
        self._controls: ControlsStore | None = None
        self._subjects: SubjectsStore | None = None
        self._lease: LeaderLease | None = None
        self._runner: web.AppRunner | None = None
        self._ticker: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Open the store and listen on host:port; MetaStartupError when either cannot be done."""
        if self._executor is not None:
            raise RuntimeError("MetaServer.start() was called twice")
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="qmq-meta-store")
        try:
            await self._call(self._open)
            await self._listen()
            assert self._store is not None
            self._lease = LeaderLease(self._store, self.owner, self.url, self.config.leader_lease_ms)
            await self.tick()
        except MetaStoreError as exc:
            await self.stop()
            raise MetaStartupError(str(exc)) from None
        except BaseException:
            await self.stop()
            raise
        if self.autotick:
            self._ticker = asyncio.get_running_loop().create_task(self._tick_forever())

    def _open(self) -> None:
        url = self.config.db_url or sqlite_url(self.config.data_dir)
        self._store = MetaStore(url)
        try:
            self._registry = Registry(
                self._store,
                self.clock,
                heartbeat_timeout_ms=self.config.heartbeat_timeout_ms,
                route_groups=self.config.route_groups,
                owner=self.owner,
            )
            self._operations = Operations(
                self._store, self._registry, self.clock, heartbeat_timeout_ms=self.config.heartbeat_timeout_ms
            )
            self._push = PushStore(self._store)
            self._alarms = AlarmStore(self._store)
            self._limits = LimitsStore(self._store)
            self._controls = ControlsStore(self._store)
            self._subjects = SubjectsStore(self._store)
        except BaseException:
            self._store.close()
            self._store = None
            raise

    async def _listen(self) -> None:
        middlewares = [self._observe]
        try:
            warning = check_exposure("meta server", self.config.host, self.config.auth_file, self.config.insecure)
        except ConfigError as exc:
            raise MetaStartupError(str(exc)) from None
        if warning is not None:
            log.warning("%s", warning)
            print(f"qmq meta: {warning}", file=sys.stderr, flush=True)
        if self.config.auth_file:
            try:
                auth = load_auth_file(Path(self.config.auth_file))
            except ConfigError as exc:
                raise MetaStartupError(str(exc)) from None
            self.http_auth = HttpAuth(auth, _needs, self.metrics.registry)
            middlewares.append(self.http_auth.middleware)
        app = web.Application(middlewares=middlewares, client_max_size=REGISTER_BODY_BYTES_MAX)
        ClusterApi(self._call, self._json_body, self._cluster_parts, self.metrics, self.clock).add_routes(app)
        OperationsApi(self._call, self._json_body, self._operations_now).add_to(app)
        PushApi(self._call, self._push_now, self.clock).add_routes(app)
        self._alarm_api.add_routes(app)
        LimitsApi(self._call, self._limits_now, self.clock.now_ms).add_routes(app)
        reads = BrokerReads(self._masters, outgoing_context(self.config))
        ControlsApi(
            self._call,
            self._controls_now,
            self.clock.now_ms,
            lambda subject, group, request: reads.ordered(subject, group, credentials_of(request)),
        ).add_routes(app)
        SubjectsApi(self._call, self._subjects_now, self.clock.now_ms, reads).add_routes(app)
        GroupsApi(reads, self._is_paused).add_routes(app)
        ConsoleApi(lambda: self.meta_server_url, auth=self.http_auth is not None).add_routes(app)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        self._runner = web.AppRunner(
            app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S, max_line_size=REQUEST_LINE_BYTES_MAX
        )
        await self._runner.setup()
        host, port = self.config.host, self.config.port
        try:
            tls = server_context(self.config)
        except ConfigError as exc:
            raise MetaStartupError(str(exc)) from None
        try:
            await web.TCPSite(self._runner, host, port, ssl_context=tls).start()
        except OSError as exc:
            raise MetaStartupError(_bind_problem(host, port, exc)) from None
        self.port = int(self._runner.addresses[0][1])
        self.url = f"{'https' if tls is not None else 'http'}://{_url_host(host)}:{self.port}"
        self.meta_server_url = self.url + ADDRESS_PATH

    def reload_auth(self) -> None:
        """Read the auth file again (SIGHUP); a wrong new file is logged and the old one kept."""
        if self.http_auth is not None:
            self.http_auth.reload_file(self.config.auth_file)

    async def stop(self) -> None:
        """Stop listening, let requests in flight finish (bounded), give up the lease, close the store."""
        if self._ticker is not None:
            ticker, self._ticker = self._ticker, None
            ticker.cancel()
            await asyncio.gather(ticker, return_exceptions=True)
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        await self._alarm_api.close()
        if self._executor is not None:
            executor, self._executor = self._executor, None
            store, self._store, self._registry = self._store, None, None
            self._operations, self._push, self._limits, self._alarms = None, None, None, None
            self._controls, self._subjects = None, None
            lease, self._lease = self._lease, None
            loop = asyncio.get_running_loop()
            if lease is not None:
                try:
                    await loop.run_in_executor(executor, lease.release)
                except MetaStoreError as exc:
                    log.warning("could not give up the leader lease (it runs out by itself): %s", exc)
            if store is not None:
                await loop.run_in_executor(executor, store.close)
            # The one thread is idle now (the close above was its last task), so this is instant.
            executor.shutdown(wait=True)

    async def _call(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise MetaStoreError("the meta server is stopped")
        return await asyncio.get_running_loop().run_in_executor(self._executor, functools.partial(fn, *args))

    def _registry_now(self) -> Registry:
        return _running(self._registry)

    def _limits_now(self) -> LimitsStore:
        return _running(self._limits)

    def _controls_now(self) -> ControlsStore:
        return _running(self._controls)

    async def _masters(self, role: Literal["broker", "delay"]) -> dict[str, str]:
        """{group: its master's address} of the available groups of ``role``."""
        groups = await self._call(lambda: self._registry_now().groups(role))
        return {g.group: g.address for g in groups if g.state == "available"}

    async def _is_paused(self, subject: str, group: str) -> bool:
        paused = await self._call(lambda: self._controls_now().paused())
        return (subject, group) in paused

    def _subjects_now(self) -> SubjectsStore:
        return _running(self._subjects)

    def _operations_now(self) -> Operations:
        return _running(self._operations)

    def _push_now(self) -> PushStore:
        return _running(self._push)

    def _alarms_now(self) -> AlarmStore:
        return _running(self._alarms)

    def _cluster_parts(self) -> ClusterParts:
        return ClusterParts(
            self._registry_now(),
            self._operations_now(),
            self._lease_now(),
            _running(self._store),
            self.config,
            self.owner,
            self.url,
            self.interval_ms,
        )

    def _lease_now(self) -> LeaderLease:
        return _running(self._lease)

    async def tick(self) -> list[Promotion]:
        """Take or renew the leader lease; leading with auto_promote on, promote where due."""
        promotions = await self._call(self._tick)
        for p in promotions:
            self.metrics.promotions.labels(role=p.group.role, how="auto").inc()
        notices, self._alarm_notices = self._alarm_notices, []
        self._alarm_api.notify(notices)
        return promotions

    def _tick(self) -> list[Promotion]:
        leads = self._lease_now().acquire(self.clock.now_ms())
        self.metrics.leader.set(1 if leads else 0)
        if not leads:
            return []
        registry = self._registry_now()
        registry.forget_silent()
        promotions = registry.check_promotions() if self.config.auto_promote else []
        for p in promotions:
            detail = f"{p.group.master} master in epoch {p.group.epoch} (was {p.previous_master}, silent)"
            self._operations_now().record_promotion(p.group.role, p.group.group, self.owner, detail)
        try:  # the leader checks the backlog alarms (qmq.meta.alarms)
            self._alarm_notices.extend(self._alarms_now().check(self.clock.now_ms()))
        except MetaStoreError as exc:
            log.warning("checking the backlog alarms failed: %s", exc)
        return promotions

    async def _tick_forever(self) -> None:
        failures = 0
        while True:
            await asyncio.sleep(self.tick_ms / 1000)  # the period of the tick, not a wait for readiness
            try:
                await self.tick()
                failures = 0
            except (MetaStoreError, RegistryFullError) as exc:
                failures += 1
                # first, then rarely: a database outage must not flood the log
                if failures == 1 or failures % 100 == 0:
                    log.warning("leader tick failed %d time(s): %s", failures, exc)
            except Exception:
                log.exception("leader tick failed")

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
            response = error_response(exc.status, f"{request.method} {request.path}: {exc.reason}")
            if "Allow" in exc.headers:
                response.headers["Allow"] = exc.headers["Allow"]
        except (MetaStoreError, RegistryFullError) as exc:
            log.warning("%s %s: %s", request.method, request.path, exc)
            response = error_response(503, str(exc))
        except Exception:
            log.exception("%s %s failed", request.method, request.path)
            response = error_response(
                500, f"{request.method} {request.path}: internal error of the meta server (see its log)"
            )
        self.metrics.http_requests.labels(path=path, status=str(response.status)).inc()
        return response

    async def _json_body(self, request: web.Request, what: str) -> object:
        raw = await request.read()
        try:
            return json.loads(raw)
        except (ValueError, UnicodeDecodeError) as exc:
            raise PayloadError("body", f"the {what} body is not JSON ({exc}); send a JSON object") from None
        except RecursionError:  # json.loads recurses once per level of nesting
            raise PayloadError(
                "body", f"the {what} body nests JSON arrays or objects too deeply; send a flat JSON object"
            ) from None

    async def _health(self, request: web.Request) -> web.Response:
        """Alive while it answers; ready when its store answers too (it serves routes from it)."""
        body: dict[str, object] = {"ok": True, "alive": True, "ready": True}
        try:
            await self._call(lambda: self._registry_now().counts())
        except Exception as exc:  # the store is away: alive, not ready
            body.update(ok=False, ready=False, error=f"the meta store does not answer: {exc}")
        return web.json_response(with_probe_error(request, body), status=probe_status(request, body))

    async def _metrics(self, _request: web.Request) -> web.Response:
        counts = await self._call(lambda: self._registry_now().counts())
        return web.Response(body=self.metrics.render(counts), headers={"Content-Type": CONTENT_TYPE})


def _needs(request: web.Request) -> Need:
    """What a request needs its app to be allowed, with an auth file: registration (and its
    heartbeats, and the push leases of gateways, which carry the subscriptions' secrets) only the
    cluster's own servers; promotion, any other change and the console an admin; reading
    any known app; /health nobody."""
    path = request.path
    if path == "/health":
        return "open"
    if path in (REGISTER_PATH, PUSH_LEASE_PATH, PUSH_RELEASE_PATH):
        return Action.CLUSTER
    if path == CONSOLE_PATH or path.startswith(CONSOLE_PATH + "/"):
        return Action.ADMIN  # the console's pages and their static files alike
    if request.method in ("GET", "HEAD") and path != PROMOTE_PATH:
        return "authenticated"
    return Action.ADMIN


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
        return f"cannot listen on {where}: {host!r} is not an address of this machine; set host to one (e.g. 127.0.0.1)"
    return f"cannot listen on {where}: {exc.strerror or exc}"


def run_meta(config: MetaConfig) -> int:
    """Run a meta server until SIGTERM or SIGINT; 0 after a clean shutdown, 3 when it cannot start.

    Prints one line to stdout once it serves: ``qmq ready role=meta meta_server=URL http=URL console=URL``.
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
        if server.http_auth is not None:
            loop.add_signal_handler(signal.SIGHUP, server.reload_auth)
        try:
            print(
                f"qmq ready role=meta meta_server={server.meta_server_url} http={server.url} "
                f"console={server.url}{CONSOLE_PATH}/",
                flush=True,
            )
            await stop.wait()
            log.info("meta server on %s shutting down", server.url)
        finally:
            await server.stop()
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)
    return 0
