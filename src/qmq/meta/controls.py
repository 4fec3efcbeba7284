"""Control-plane records of consumer groups, kept by the meta server in ``qmq_meta_group_controls``:

    GET  /meta/controls                   what brokers apply: {"paused": [[subject, group], ...],
                                          "filters": [[subject, group, expr], ...]}
    POST /meta/controls/pause             {"subject", "group"}: the group's consumers get nothing
    POST /meta/controls/resume            {"subject", "group"}: they get messages again
    POST /meta/controls/filter            {"subject", "group", "expr"}: the group gets only the
                                          messages the JMESPath ``expr`` matches (null: all);
                                          an invalid one is refused naming the position
    POST /meta/controls/transform         {"subject", "group", "expr"}: the group's HTTP consumers
                                          (gateway pulls, push) get the JMESPath ``expr``'s result
                                          as the body (null: the stored body); checked as a filter

``GET /meta/controls`` also answers ``"transforms": [[subject, group, expr], ...]``, which the
gateways apply (qmq.gateway.transforms).

A paused group keeps its progress and every message; brokers ask every ``POLL_S`` of
qmq.broker.controls (well under a second), so a pause or resume holds on every broker within a
second, and across restarts of the meta server and of the brokers. With an auth file, reading
needs any known app and a change an admin app (qmq.meta.server).
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable
from typing import Any, Final

import sqlalchemy as sa
from aiohttp import web

from qmq.common.errors import InvalidSubjectError, QmqError
from qmq.common.filter_expr import compile_filter
from qmq.common.naming import check_name
from qmq.meta.schema import GROUP_CHARS, SUBJECT_CHARS, metadata, name_type
from qmq.meta.store import MetaStore, MetaStoreError

CONTROLS_PATH: Final = "/meta/controls"
PAUSE_PATH: Final = "/meta/controls/pause"
RESUME_PATH: Final = "/meta/controls/resume"
FILTER_PATH: Final = "/meta/controls/filter"
TRANSFORM_PATH: Final = "/meta/controls/transform"
CONTROLS_MAX: Final = 10_000

controls_table = sa.Table(
    "qmq_meta_group_controls",
    metadata,
    sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
    sa.Column("paused", sa.Boolean, nullable=False),
    sa.Column("updated_ms", sa.BigInteger, nullable=False),
)


def _expr_table(name: str) -> sa.Table:
    """A table of one JMESPath expression per (subject, group): filters, transforms."""
    return sa.Table(
        name,
        metadata,
        sa.Column("subject", name_type(SUBJECT_CHARS), primary_key=True),
        sa.Column("group_name", name_type(GROUP_CHARS), primary_key=True),
        sa.Column("expr", sa.Text, nullable=False),
        sa.Column("updated_ms", sa.BigInteger, nullable=False),
    )


filters_table = _expr_table("qmq_meta_group_filters")
transforms_table = _expr_table("qmq_meta_group_transforms")

_EXPR_TABLES: Final = {"filter": filters_table, "transform": transforms_table}

Call = Callable[..., Awaitable[Any]]


class ControlsFullError(MetaStoreError):
    retriable = False


class ControlsStore:
    def __init__(self, store: MetaStore) -> None:
        self._store = store

    def set_paused(self, subject: str, group: str, paused: bool, now_ms: int) -> bool:
        """Pause or resume; whether the group was paused before."""
        t = controls_table
        with self._store.transaction("pause or resume a group") as conn:
            key = (t.c.subject == subject) & (t.c.group_name == group)
            before = conn.scalar(sa.select(t.c.paused).where(key))
            if before is not None:
                conn.execute(sa.update(t).where(key).values(paused=paused, updated_ms=now_ms))
                return bool(before)
            if not paused:
                return False
            count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
            if count >= CONTROLS_MAX:
                raise ControlsFullError(
                    f"the meta server keeps at most {CONTROLS_MAX} group controls; resume a paused group first"
                )
            conn.execute(sa.insert(t).values(subject=subject, group_name=group, paused=True, updated_ms=now_ms))
            return False

    def paused(self) -> list[tuple[str, str]]:
        t = controls_table
        with self._store.transaction("read the paused groups") as conn:
            rows = conn.execute(
                sa.select(t.c.subject, t.c.group_name)
                .where(t.c.paused.is_(True))
                .order_by(t.c.subject, t.c.group_name)
                .limit(CONTROLS_MAX)
            ).all()
        return [(str(r.subject), str(r.group_name)) for r in rows]

    def set_filter(self, subject: str, group: str, expr: str | None, now_ms: int) -> str | None:
        """Set (``expr``) or clear (None) a group's filter; the expression it had before."""
        return self.set_expr("filter", subject, group, expr, now_ms)

    def set_expr(self, kind: str, subject: str, group: str, expr: str | None, now_ms: int) -> str | None:
        """Set (``expr``) or clear (None) a group's ``kind`` ("filter" or "transform"); the
        expression it had before."""
        t = _EXPR_TABLES[kind]
        with self._store.transaction(f"set a group {kind}") as conn:
            key = (t.c.subject == subject) & (t.c.group_name == group)
            before = conn.scalar(sa.select(t.c.expr).where(key))
            if expr is None:
                conn.execute(sa.delete(t).where(key))
            elif before is not None:
                conn.execute(sa.update(t).where(key).values(expr=expr, updated_ms=now_ms))
            else:
                count = int(conn.scalar(sa.select(sa.func.count()).select_from(t)) or 0)
                if count >= CONTROLS_MAX:
                    raise ControlsFullError(
                        f"the meta server keeps at most {CONTROLS_MAX} group {kind}s; clear one first"
                    )
                conn.execute(sa.insert(t).values(subject=subject, group_name=group, expr=expr, updated_ms=now_ms))
            return None if before is None else str(before)

    def filters(self) -> list[tuple[str, str, str]]:
        return self.exprs("filter")

    def exprs(self, kind: str) -> list[tuple[str, str, str]]:
        """Every group's ``kind`` ("filter" or "transform"): (subject, group, expr)."""
        t = _EXPR_TABLES[kind]
        with self._store.transaction(f"read the group {kind}s") as conn:
            rows = conn.execute(
                sa.select(t.c.subject, t.c.group_name, t.c.expr)
                .order_by(t.c.subject, t.c.group_name)
                .limit(CONTROLS_MAX)
            ).all()
        return [(str(r.subject), str(r.group_name), str(r.expr)) for r in rows]


class ControlError(ValueError):
    """A field of a control request is wrong; the text names it."""


def _ordered_refusal(subject: str, group: str) -> str:
    return (
        f"consumer group {group!r} of {subject!r} consumes in order: an ordered group takes whole slots, never "
        "filtered, so it can have no filter; filter in its handler, or use another (unordered) group"
    )


def parse_group(doc: object, extra: frozenset[str] = frozenset()) -> tuple[str, str]:
    """(subject, group) of a pause/resume body; ControlError naming the field at fault."""
    if not isinstance(doc, dict):
        raise ControlError('the body must be a JSON object {"subject": ..., "group": ...}')
    unknown = sorted(set(doc) - {"subject", "group", *extra})
    if unknown:
        known = ", ".join(["subject", "group", *sorted(extra)])
        raise ControlError(f"unknown field(s) {', '.join(unknown)}; known: {known}")
    try:
        subject = check_name("subject", doc.get("subject"))
        group = check_name("consumer group", doc.get("group"))
    except InvalidSubjectError as exc:
        raise ControlError(str(exc)) from None
    if len(group) > GROUP_CHARS:
        raise ControlError(f"consumer group {group[:40]!r}… has {len(group)} characters; the limit is {GROUP_CHARS}")
    return subject, group


class ControlsApi:
    """The control routes of one meta server: ``call`` runs a function on its store thread."""

    def __init__(
        self,
        call: Call,
        store: Callable[[], ControlsStore],
        now_ms: Callable[[], int],
        ordered: Callable[[str, str, web.Request], Awaitable[bool]] | None = None,
    ) -> None:
        self._call = call
        self._store = store
        self._now_ms = now_ms
        self._ordered = ordered  # asks the brokers whether a group consumes in order (qmq.meta.broker_reads)

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(CONTROLS_PATH, self._list)
        app.router.add_post(PAUSE_PATH, self._pause)
        app.router.add_post(RESUME_PATH, self._resume)
        app.router.add_post(FILTER_PATH, self._filter)
        app.router.add_post(TRANSFORM_PATH, self._transform)

    async def _list(self, _request: web.Request) -> web.Response:
        paused = await self._call(lambda: self._store().paused())
        filters = await self._call(lambda: self._store().exprs("filter"))
        transforms = await self._call(lambda: self._store().exprs("transform"))
        return web.json_response(
            {
                "paused": [list(p) for p in paused],
                "filters": [list(f) for f in filters],
                "transforms": [list(t) for t in transforms],
            }
        )

    async def _pause(self, request: web.Request) -> web.Response:
        return await self._set(request, paused=True)

    async def _resume(self, request: web.Request) -> web.Response:
        return await self._set(request, paused=False)

    async def _set(self, request: web.Request, paused: bool) -> web.Response:
        try:
            subject, group = parse_group(json.loads(await request.read()))
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return web.json_response({"error": f"{exc}"}, status=400)
        try:
            before = await self._call(lambda: self._store().set_paused(subject, group, paused, self._now_ms()))
        except ControlsFullError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"ok": True, "subject": subject, "group": group, "paused": paused, "was": before})

    async def _filter(self, request: web.Request) -> web.Response:
        return await self._set_expr(request, "filter")

    async def _transform(self, request: web.Request) -> web.Response:
        return await self._set_expr(request, "transform")

    async def _set_expr(self, request: web.Request, kind: str) -> web.Response:
        try:
            doc = json.loads(await request.read())
            subject, group = parse_group(doc, frozenset({"expr"}))
            expr = doc.get("expr")
            if expr is not None:
                compile_filter(expr, kind)  # refused here, with the position, rather than skipped where it runs
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return web.json_response({"error": f"{exc}"}, status=400)
        if kind == "filter" and expr is not None and self._ordered is not None:
            try:
                ordered = await self._ordered(subject, group, request)
            except (QmqError, OSError, TimeoutError):
                ordered = False  # not known: a broker that knows it refuses the group's ordered pulls instead
            if ordered:
                return web.json_response({"error": _ordered_refusal(subject, group)}, status=409)
        try:
            before = await self._call(lambda: self._store().set_expr(kind, subject, group, expr, self._now_ms()))
        except ControlsFullError as exc:
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response({"ok": True, "subject": subject, "group": group, "expr": expr, "was": before})
