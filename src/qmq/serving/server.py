"""The shell of a role that takes frames and keeps a store (the broker, the delay server):
what it shares around its handlers and its state.

- the frame port and its connections (``qmq.serving.connection.ConnectionHost``): a frame goes
  straight to the role's request table (``dispatch``, ``qmq.serving.dispatch``);
- the HTTP port with ``/metrics`` and ``/health``, and the ``qmq ready`` line naming both;
- registration with the meta server, periodic jobs, and one checkpoint at a time on a thread
  of its own (a checkpoint's fsyncs never queue behind, or ahead of, the group commit's);
- the steps of an ordered shutdown, each a method, which the role calls in its own order
  with its own steps between them.

A role subclasses ``FrameServer``, sets ``kind`` and ``title``, builds its state and its
handlers, points ``dispatch`` at their request table, and writes ``start``, ``checkpoint``,
``health`` and ``stop`` from these pieces.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import ssl
import sys
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter

from qmq.auth.exposure import check_exposure
from qmq.auth.file import load_auth_file
from qmq.auth.handshake import ClientCredentials
from qmq.auth.http import basic_authorization
from qmq.auth.secrets import SECRET_ENV
from qmq.common.errors import ConfigError
from qmq.common.limits import Limits
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.serving.auth_gate import AuthGate
from qmq.serving.connection import ConnectionLimits, Connections, FrameConnection, Responder
from qmq.serving.dispatch import RoleHandlers
from qmq.serving.group_commit import GroupCommit
from qmq.serving.limits import LimitsPoller
from qmq.serving.periodic import Periodic
from qmq.serving.probes import probe_status, with_probe_error
from qmq.serving.registration import Registration, server_payload
from qmq.serving.resources import register_resources
from qmq.serving.runner import StartupError, listen_error, serve_http
from qmq.serving.tls import outgoing_context, server_context
from qmq.store.datadir import StoreError

log = logging.getLogger(__name__)

# Prometheus text format 0.0.4, what prometheus_client's generate_latest writes
METRICS_CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LISTEN_BACKLOG = 1024


class ServingConfig(Protocol):
    """The fields of a role's config the shell reads."""

    @property
    def data_dir(self) -> Path: ...
    @property
    def host(self) -> str: ...
    @property
    def port(self) -> int: ...
    @property
    def http_port(self) -> int: ...
    @property
    def group(self) -> str: ...
    @property
    def meta_server(self) -> str: ...
    @property
    def heartbeat_interval_ms(self) -> int: ...
    @property
    def connections_max(self) -> int: ...
    @property
    def connections_per_host_max(self) -> int: ...
    @property
    def first_request_timeout_ms(self) -> int: ...
    @property
    def reply_backlog_bytes_max(self) -> int: ...
    @property
    def auth_file(self) -> str: ...
    @property
    def app_code(self) -> str: ...
    @property
    def insecure(self) -> bool: ...
    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...
    @property
    def tls_ca(self) -> str: ...


class RoleStore(Protocol):
    """The role's store, as far as the shell is concerned: closed last at shutdown."""

    def close(self) -> None: ...


class RoleMetrics(Protocol):
    """The role's metrics registry, rendered for GET /metrics, with the counters of the
    connections the server refused (by reason) and closed on its own (by reason)."""

    @property
    def connections_refused(self) -> Counter: ...
    @property
    def connections_dropped(self) -> Counter: ...

    @property
    def registry(self) -> CollectorRegistry: ...

    def render(self) -> bytes: ...


class FrameServer(ABC):
    # At most one send frame is handled per loop turn: the rest of what a connection sent waits
    # for the next turn, which is fair to the other connections and, on a delay server, delays
    # due messages by one frame's work rather than a burst's.
    yield_after: frozenset[int] = frozenset({RequestCode.SEND_MESSAGES})
    kind: str  # the role it is, in the ready line and the registration: "broker", "delay"
    title: str  # names the server in errors: "broker", "delay server"

    config: ServingConfig  # a role narrows it to its own config
    # set by the role: the request table of its handlers, the store and what fsyncs its log
    dispatch: Callable[[Responder, Frame], None]
    handlers: RoleHandlers
    store: RoleStore
    metrics: RoleMetrics
    flusher: GroupCommit

    def __init__(
        self,
        config: ServingConfig,
        limits: Limits,
        on_connections: Callable[[int], None],
        checkpoint_thread: str,
    ) -> None:
        self.config = config
        self.limits = limits
        self.connections = Connections(
            ConnectionLimits(
                config.connections_max,
                config.first_request_timeout_ms,
                config.reply_backlog_bytes_max,
                config.connections_per_host_max,
            ),
            self._refusal,
            on_connections,
            lambda reason: self.metrics.connections_refused.labels(reason).inc(),
            lambda reason: self.metrics.connections_dropped.labels(reason).inc(),
        )
        self.periodic = Periodic()
        self.stopping = False
        self.port = 0
        self.http_port = 0
        self._server: asyncio.Server | None = None
        self._http: web.AppRunner | None = None
        self._registration: Registration | None = None
        self._limits: LimitsPoller | None = None
        # set once the store is open (start): from then on a shutdown writes a final checkpoint
        self.checkpointing: asyncio.Lock | None = None
        self.stop_failed: str | None = None  # what the last stop could not finish (exit status 4)
        self.checkpoint_executor = ThreadPoolExecutor(1, thread_name_prefix=checkpoint_thread)
        self.auth: AuthGate | None = None
        # what the server connects to the other roles with (qmq.serving.tls); ConfigError for bad files
        self.tls_out: ssl.SSLContext | None = outgoing_context(config)

    @property
    def address(self) -> str:
        return f"{self.config.host}:{self.port}"

    @property
    def http_url(self) -> str:
        scheme = "https" if self.config.tls_cert else "http"
        return f"{scheme}://{self.config.host}:{self.http_port}"

    def ready_line(self) -> str:
        return (
            f"qmq ready role={self.kind} group={self.config.group} address={self.address} "
            f"http={self.http_url} pid={os.getpid()}"
        )

    # -- connections (qmq.serving.connection.ConnectionHost) ---------------------------

    def _refusal(self, setting: str, host: str) -> str:
        """What a client refused past ``setting`` (connections_max, connections_per_host_max) is told."""
        cfg = self.config
        if setting == "connections_per_host_max":
            held = f"{cfg.connections_per_host_max} client connections open from {host}"
        else:
            held = f"{cfg.connections_max} client connections open"
        flag = "--" + setting.replace("_", "-")
        return (
            f"the {self.title} refuses the connection: it has {setting} {held}; raise {setting} ({flag}, or "
            f"{setting} in [{self.kind}] of its config file), or close idle connections"
        )

    def forget(self, conn: FrameConnection) -> None:
        """A connection closed; a role that keeps state per connection extends this."""
        self.connections.forget(conn)

    # -- start -------------------------------------------------------------------------

    async def listen(self) -> None:
        """Listen for frames, then serve /metrics and /health; StartupError naming a port in use."""
        cfg = self.config
        loop = asyncio.get_running_loop()
        warning = check_exposure(self.title, cfg.host, cfg.auth_file, cfg.insecure)
        if warning is not None:
            log.warning("%s", warning)
            print(f"qmq {self.kind}: {warning}", file=sys.stderr, flush=True)
        if cfg.auth_file:
            self._gate_requests(loop)
        tls = server_context(cfg)
        try:
            self._server = await loop.create_server(
                lambda: FrameConnection(self), cfg.host, cfg.port, backlog=_LISTEN_BACKLOG, ssl=tls
            )
        except OSError as exc:
            raise StartupError(listen_error(self.title, cfg.host, cfg.port, exc, "--port")) from None
        self.port = self._server.sockets[0].getsockname()[1]
        register_resources(self.metrics.registry, Path(cfg.data_dir))  # CPU, memory, disk: qmq top
        app = web.Application()
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/health", self._health)
        self._http, self.http_port = await serve_http(app, cfg.host, cfg.http_port, "metrics", "--http-port", tls)

    def _gate_requests(self, loop: asyncio.AbstractEventLoop) -> None:
        """Read the auth file and put its gate in front of the request table; SIGHUP reloads it."""
        gate = self.auth = AuthGate(load_auth_file(Path(self.config.auth_file)), self.metrics.registry, "qmq")
        self.dispatch = gate.wrap(self.dispatch)
        self.handlers.deny = gate.deny
        self.handlers.over_quota = gate.over_quota
        loop.add_signal_handler(signal.SIGHUP, self.reload_auth)
        log.info("%s: authentication on, %d app(s) in %s", self.title, len(gate.auth.apps), self.config.auth_file)

    def reload_auth(self) -> None:
        """Read the auth file again (SIGHUP); connections stay open. A bad file keeps the old one."""
        if self.auth is None:
            return
        try:
            auth = load_auth_file(Path(self.config.auth_file))
        except ConfigError as exc:
            log.error("SIGHUP: kept the auth file in use, the new one is wrong: %s", exc)
            return
        self.auth.reload(auth)
        log.info("SIGHUP: reloaded %s, %d app(s)", self.config.auth_file, len(auth.apps))

    def register(
        self,
        payload: dict[str, Any] | Callable[[], dict[str, Any]],
        on_answer: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        """Start heartbeats to the meta server (``qmq.serving.registration``)."""
        cfg = self.config
        secret = self.secret()
        authorization = basic_authorization(cfg.app_code, secret) if secret else None
        self._registration = Registration(
            cfg.meta_server,
            payload,
            cfg.heartbeat_interval_ms,
            on_answer=on_answer,
            authorization=authorization,
            ssl=self.tls_out,
        )
        self._registration.start()
        if self.auth is not None:
            gate = self.auth
            self._limits = LimitsPoller(
                cfg.meta_server, lambda rules: setattr(gate, "runtime", rules), authorization, self.tls_out
            )
            self._limits.start()

    def secret(self) -> str:
        """The secret of the server's own app (``app_code``), from $QMQ_SECRET; "" without an app code."""
        return os.environ.get(SECRET_ENV, "") if self.config.app_code else ""

    def credentials(self) -> ClientCredentials | None:
        """What the server authenticates with to the other roles' frame ports, or None."""
        secret = self.secret()
        return ClientCredentials(self.config.app_code, secret) if secret else None

    def registration_payload(self) -> dict[str, Any]:
        cfg = self.config
        return server_payload(self.kind, cfg.group, self.address, f"{cfg.host}:{self.http_port}")

    async def wait_registered(self) -> None:
        if self._registration is not None:
            await self._registration.registered.wait()

    # -- HTTP --------------------------------------------------------------------------

    @abstractmethod
    def health(self) -> dict[str, object]:
        """The body of GET /health; its "ok" says 200 or 503."""

    async def _metrics(self, _request: web.Request) -> web.Response:
        return web.Response(body=self.metrics.render(), headers={"Content-Type": METRICS_CONTENT_TYPE})

    def registered(self) -> bool:
        """Whether the meta server has answered this server's registration (routes may name it);
        true for a server run without a meta server."""
        if not self.config.meta_server:
            return True
        return self._registration is not None and self._registration.registered.is_set()

    async def _health(self, request: web.Request) -> web.Response:
        body = self.health()
        # HTTP serves once recovery is done, so a server that answers is alive; ready once registered too
        body["alive"] = True
        body["ready"] = bool(body["ok"]) and self.registered()
        return web.json_response(with_probe_error(request, body), status=probe_status(request, body))

    # -- checkpoints ---------------------------------------------------------------------

    @abstractmethod
    async def checkpoint(self) -> None:
        """Make the store durable and record how far (on the checkpoint thread, under ``checkpointing``)."""

    # -- steps of an ordered shutdown, in the order a role calls them ------------------------

    async def stop_listening(self) -> None:
        """Take no new connections and stop heartbeats (the meta server stops routing here)."""
        if self._server is not None:
            self._server.close()
        if self._registration is not None:
            await self._registration.stop()
        if self._limits is not None:
            await self._limits.stop()

    async def drain_writes(self, grace_s: float) -> None:
        """Answer the sends waiting for their fsync, for at most ``grace_s``."""
        if not await self.flusher.drain(grace_s):
            log.warning("shutdown: %d sends were still waiting for fsync after the grace period", self.flusher.waiting)

    async def final_checkpoint(self) -> None:
        """Checkpoint once more if the store was opened, so a restart replays little."""
        if self.checkpointing is None:
            return
        try:
            await self.checkpoint()
        except (OSError, StoreError) as exc:
            log.error("shutdown: the final checkpoint failed: %s", exc)
            self.stop_failed = (
                f"the final checkpoint failed ({exc}); the next start replays the logs from the last good one"
            )

    async def close_connections(self) -> None:
        """Close every connection (each told how many of its requests were read), then the
        frame port and the HTTP port."""
        self.connections.close_all(f"{self.kind} {self.address} is shutting down; retry")
        if self._server is not None:
            await self._server.wait_closed()
        if self._http is not None:
            await self._http.cleanup()

    async def close_store(self) -> None:
        """Stop the group commit and the checkpoint thread, then close the store's files."""
        await self.flusher.stop()
        self.checkpoint_executor.shutdown(wait=True)
        self.store.close()
