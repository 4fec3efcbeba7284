"""The meta server's cluster routes: where subjects live, registration and heartbeats of the
brokers and delay servers, the cluster view, and promotion by hand.

    GET  /meta/address[?subject=S...]  groups, their states and the routes of the subjects asked for
    POST /meta/register                a broker or delay server reporting itself (also its heartbeat);
                                       the answer says what it must be (docs/cluster.md)
    GET  /meta/cluster[?routes_max=N]  every group and server, routes, the leading meta server
    POST /meta/promote                 {"group": G, "role": "broker"}: make G's freshest slave master
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, NamedTuple, TypeVar

from aiohttp import web

from qmq.common.clock import Clock
from qmq.common.config import MetaConfig
from qmq.common.errors import QmqError
from qmq.meta.leader import LeaderLease
from qmq.meta.metrics import MetaMetrics
from qmq.meta.operations import GroupRemovedError, Operations, parse_unconsumed
from qmq.meta.payload import PayloadError, parse_promote, parse_registration, parse_subjects
from qmq.meta.registry import (
    ROLES,
    Promotion,
    PromotionRefusedError,
    Registration,
    Registry,
    Reported,
    UnknownGroupError,
)
from qmq.meta.schema import OWNER_CHARS
from qmq.meta.store import MetaStore
from qmq.meta.views import MetaSelf, address_json, cluster_json, heartbeat_json

log = logging.getLogger(__name__)

T = TypeVar("T")

ADDRESS_PATH: Final = "/meta/address"
REGISTER_PATH: Final = "/meta/register"
CLUSTER_PATH: Final = "/meta/cluster"
PROMOTE_PATH: Final = "/meta/promote"
# Routes listed by GET /meta/cluster: by default, and at most when asked (the rest are counted).
CLUSTER_ROUTES_DEFAULT: Final = 1_000
CLUSTER_ROUTES_MAX: Final = 10_000


class ClusterParts(NamedTuple):
    """What the cluster routes read of a running meta server (its parts exist while it runs)."""

    registry: Registry
    operations: Operations
    lease: LeaderLease
    store: MetaStore
    config: MetaConfig
    owner: str
    url: str
    interval_ms: int


class _NotLeaderError(QmqError):
    """Another meta server holds the leader lease; ``leader_url`` is where to ask instead."""

    def __init__(self, text: str, leader_url: str) -> None:
        super().__init__(text)
        self.leader_url = leader_url


def error_response(status: int, text: str, field: str | None = None) -> web.Response:
    """The meta server's error answer: ``{"error": text, "field": field}``."""
    body: dict[str, Any] = {"error": text}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


class ClusterApi:
    def __init__(
        self,
        call: Callable[..., Awaitable[Any]],
        json_body: Callable[[web.Request, str], Awaitable[object]],
        parts: Callable[[], ClusterParts],
        metrics: MetaMetrics,
        clock: Clock,
    ) -> None:
        self._call = call
        self._json_body = json_body
        self._parts = parts
        self.metrics = metrics
        self.clock = clock

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(ADDRESS_PATH, self._address)
        app.router.add_post(REGISTER_PATH, self._register)
        app.router.add_get(CLUSTER_PATH, self._cluster)
        app.router.add_post(PROMOTE_PATH, self._promote)

    async def _address(self, request: web.Request) -> web.Response:
        try:
            subjects = parse_subjects(request.query.getall("subject", []))
        except PayloadError as exc:
            return error_response(400, str(exc), exc.field)
        body = await self._call(self._address_view, subjects)
        return web.json_response(body)

    def _address_view(self, subjects: list[str]) -> dict[str, Any]:
        parts = self._parts()
        registry = parts.registry
        operations = parts.operations
        groups = {role: registry.groups(role) for role in ROLES}
        routes = registry.routes(subjects, operations.unwritable()) if subjects else {}
        body = address_json(groups, routes, parts.config.client_refresh_ms)
        operations.decorate_address(body)
        return body

    async def _register(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, "register")
            reg = parse_registration(body)
            unconsumed = parse_unconsumed(body)
        except PayloadError as exc:
            return error_response(400, str(exc), exc.field)
        try:
            reported, draining = await self._call(self._register_now, reg, unconsumed)
        except GroupRemovedError as exc:
            return error_response(410, str(exc), "group")
        answer = reported.answer
        if reported.is_new:
            log.info(
                "registered %s %s of group %r, pid %d: reports %s epoch %s, is %s of epoch %d",
                reg.role,
                reg.address,
                reg.group,
                reg.pid,
                reg.role_in_group,
                reg.epoch,
                answer.role_in_group,
                answer.epoch,
            )
            self.metrics.registrations.labels(role=reg.role).inc()
        else:
            self.metrics.heartbeats.labels(role=reg.role).inc()
        doc = heartbeat_json(answer, self._parts().interval_ms)
        if draining:  # absent otherwise: the answer of a meta server without operations
            doc["draining"] = True
        return web.json_response(doc)

    def _register_now(self, reg: Registration, unconsumed: dict[str, Any] | None) -> tuple[Reported, bool]:
        parts = self._parts()
        operations = parts.operations
        operations.check_registration(reg.role, reg.group)
        reported = parts.registry.register(reg)
        if unconsumed is not None and reported.answer.role_in_group == "master":
            operations.record_backlog(reg.role, reg.group, reg.address, unconsumed)
        return reported, operations.is_draining(reg.role, reg.group)

    async def _cluster(self, request: web.Request) -> web.Response:
        text = request.query.get("routes_max", str(CLUSTER_ROUTES_DEFAULT))
        if not text.isascii() or not text.isdigit() or int(text) > CLUSTER_ROUTES_MAX:
            return error_response(
                400, f"routes_max {text!r} must be a whole number from 0 to {CLUSTER_ROUTES_MAX}", "routes_max"
            )
        return web.json_response(await self._call(self._cluster_view, int(text)))

    def _cluster_view(self, routes_max: int) -> dict[str, Any]:
        parts = self._parts()
        registry = parts.registry
        store = parts.store
        lease = parts.lease
        now_ms = self.clock.now_ms()
        me = MetaSelf(
            owner=parts.owner,
            url=parts.url,
            leading=lease.leads(now_ms),
            heartbeat_timeout_ms=parts.config.heartbeat_timeout_ms,
            auto_promote=parts.config.auto_promote,
            route_groups=parts.config.route_groups,
        )
        view = cluster_json(
            me,
            now_ms,
            registry.servers(),
            registry.group_records(),
            lease.holder(),
            store.routes(routes_max) if routes_max else {},
            store.subjects_routed(),
        )
        parts.operations.decorate_cluster(view)
        return view

    async def _promote(self, request: web.Request) -> web.Response:
        try:
            body = await self._json_body(request, "promote")
            role, group = parse_promote(body)
            by = body.get("by") if isinstance(body, dict) else None
            who = by[:OWNER_CHARS] if isinstance(by, str) and by.strip() else f"unnamed@{request.remote or 'unknown'}"
        except PayloadError as exc:
            return error_response(400, str(exc), exc.field)
        try:
            promotion = await self._call(self._promote_now, role, group, who)
        except UnknownGroupError as exc:
            return error_response(404, str(exc), "group")
        except PromotionRefusedError as exc:
            return error_response(409, str(exc), "group")
        except _NotLeaderError as exc:
            return web.json_response({"error": str(exc), "leader": exc.leader_url}, status=421)
        self.metrics.promotions.labels(role=role, how="manual").inc()
        g = promotion.group
        return web.json_response(
            {
                "ok": True,
                "role": g.role,
                "group": g.group,
                "epoch": g.epoch,
                "master": g.master,
                "previous_master": promotion.previous_master,
                "message_offset": g.message_offset,
                "action_offset": g.action_offset,
            }
        )

    def _promote_now(self, role: Any, group: str, who: str) -> Promotion:
        parts = self._parts()
        lease = parts.lease
        if not lease.acquire(self.clock.now_ms()):
            holder = lease.holder()
            url = holder.url if holder is not None else ""
            raise _NotLeaderError(
                f"this meta server ({parts.url}) does not lead the meta servers sharing its database; "
                f"send the promotion to the leader, {url or 'unknown'}",
                url,
            )
        self.metrics.leader.set(1)
        promotion = parts.registry.promote(role, group)
        g = promotion.group
        detail = f"{g.master} master in epoch {g.epoch} (was {promotion.previous_master}), by hand"
        parts.operations.record_promotion(role, group, who, detail)
        return promotion
