"""The rows of cluster operations in the meta store: group states, retired routes, the masters'
backlog reports and the history (tables drawn in ``qmq.meta.operations_schema``).

Every method is one short transaction over the MetaStore's engine, called from the meta
server's one store thread, like MetaStore's own.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import sqlalchemy as sa

from qmq.meta.operations_schema import (
    DETAIL_CHARS,
    HISTORY_KEPT,
    backlogs_table,
    group_states_table,
    history_table,
    route_removals_table,
)
from qmq.meta.schema import epochs_table, groups_table, routes_table, servers_table
from qmq.meta.store import MetaStore


@dataclass(frozen=True, slots=True)
class GroupState:
    """A group taken out of writing: "draining" or "removed", when and by whom."""

    role: str
    group: str
    state: str
    changed_at_ms: int
    changed_by: str


@dataclass(frozen=True, slots=True)
class Backlog:
    """What a group's master last reported unconsumed (``qmq.broker.backlog``)."""

    address: str
    total: int
    pairs: int
    top: list[tuple[str, str | None, int]]
    draining: bool
    reported_ms: int


@dataclass(frozen=True, slots=True)
class HistoryEntry:
    id: int
    at_ms: int
    who: str
    action: str
    target: str
    detail: str


class OperationsStore:
    """Operations' rows in ``store``'s database."""

    def __init__(self, store: MetaStore) -> None:
        self._store = store

    # -- group states ----------------------------------------------------------------------

    def group_states(self) -> dict[tuple[str, str], GroupState]:
        t = group_states_table
        with self._store.transaction("read the group states") as conn:
            rows = conn.execute(sa.select(t)).all()
        return {
            (r.role, r.group_name): GroupState(r.role, r.group_name, r.state, r.changed_at_ms, r.changed_by)
            for r in rows
        }

    def set_group_state(self, role: str, group: str, state: str | None, at_ms: int, by: str) -> None:
        """Set the group's state (None: writable again, its row deleted)."""
        t = group_states_table
        key = (t.c.role == role) & (t.c.group_name == group)
        with self._store.transaction("change a group's state") as conn:
            conn.execute(sa.delete(t).where(key))
            if state is not None:
                conn.execute(
                    sa.insert(t).values(role=role, group_name=group, state=state, changed_at_ms=at_ms, changed_by=by)
                )

    # -- routes ----------------------------------------------------------------------------

    def route_removals(self) -> dict[str, set[str]]:
        """Every subject's routes being retired."""
        t = route_removals_table
        out: dict[str, set[str]] = {}
        with self._store.transaction("read the retired routes") as conn:
            for subject, group in conn.execute(sa.select(t.c.subject, t.c.group_name)):
                out.setdefault(subject, set()).add(group)
        return out

    def retire_route(self, subject: str, group: str, at_ms: int, by: str) -> None:
        t = route_removals_table
        with self._store.transaction("retire a route") as conn:
            conn.execute(sa.delete(t).where(t.c.subject == subject, t.c.group_name == group))
            conn.execute(sa.insert(t).values(subject=subject, group_name=group, removed_at_ms=at_ms, removed_by=by))

    def restore_route(self, subject: str, group: str) -> bool:
        """Un-retire a route; whether it was retired."""
        t = route_removals_table
        with self._store.transaction("restore a route") as conn:
            return int(conn.execute(sa.delete(t).where(t.c.subject == subject, t.c.group_name == group)).rowcount) > 0

    def routes_sharing(self, group: str, subjects_max: int) -> dict[str, list[str]]:
        """Every route of the subjects routed to ``group`` (the first ``subjects_max`` by name)."""
        t = routes_table
        first = (
            sa.select(t.c.subject).where(t.c.group_name == group).order_by(t.c.subject).limit(subjects_max).subquery()
        )
        query = sa.select(t.c.subject, t.c.group_name).where(t.c.subject.in_(sa.select(first.c.subject)))
        out: dict[str, list[str]] = {}
        with self._store.transaction("read a group's routes") as conn:
            for subject, g in conn.execute(query.order_by(t.c.subject, t.c.group_name)):
                out.setdefault(subject, []).append(g)
        return out

    # -- backlogs --------------------------------------------------------------------------

    def save_backlog(self, role: str, group: str, backlog: Backlog) -> None:
        t = backlogs_table
        values: dict[str, Any] = {
            "address": backlog.address,
            "total": backlog.total,
            "pairs": backlog.pairs,
            "top": json.dumps([list(item) for item in backlog.top]),
            "draining": backlog.draining,
            "reported_ms": backlog.reported_ms,
        }
        key = (t.c.role == role) & (t.c.group_name == group)
        with self._store.transaction("save a backlog report") as conn:
            if conn.execute(sa.update(t).where(key).values(values)).rowcount == 0:
                conn.execute(sa.insert(t).values(role=role, group_name=group, **values))

    def backlogs(self) -> dict[tuple[str, str], Backlog]:
        t = backlogs_table
        out: dict[tuple[str, str], Backlog] = {}
        with self._store.transaction("read the backlog reports") as conn:
            for r in conn.execute(sa.select(t)):
                top = [(str(s), None if g is None else str(g), int(n)) for s, g, n in json.loads(r.top)]
                out[(r.role, r.group_name)] = Backlog(
                    r.address, int(r.total), int(r.pairs), top, bool(r.draining), int(r.reported_ms)
                )
        return out

    # -- removal ---------------------------------------------------------------------------

    def unregister_group(self, role: str, group: str, at_ms: int, by: str) -> None:
        """Forget the group (its servers, decisions, epochs, routes, reports) and keep it "removed"."""
        with self._store.transaction("remove a group") as conn:
            for t in (servers_table, groups_table, epochs_table, backlogs_table, group_states_table):
                conn.execute(sa.delete(t).where(t.c.role == role, t.c.group_name == group))
            if role == "broker":
                for t in (routes_table, route_removals_table):
                    conn.execute(sa.delete(t).where(t.c.group_name == group))
            conn.execute(
                sa.insert(group_states_table).values(
                    role=role, group_name=group, state="removed", changed_at_ms=at_ms, changed_by=by
                )
            )

    # -- history ---------------------------------------------------------------------------

    def record(self, at_ms: int, who: str, action: str, target: str, detail: str) -> None:
        t = history_table
        with self._store.transaction("record an operation") as conn:
            conn.execute(
                sa.insert(t).values(at_ms=at_ms, who=who, action=action, target=target, detail=detail[:DETAIL_CHARS])
            )
            newest = conn.scalar(sa.select(sa.func.max(t.c.id)))
            if newest is not None and newest > HISTORY_KEPT:
                conn.execute(sa.delete(t).where(t.c.id <= newest - HISTORY_KEPT))

    def history(self, limit: int) -> list[HistoryEntry]:
        """The latest ``limit`` operations, oldest first."""
        t = history_table
        with self._store.transaction("read the history") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.id.desc()).limit(limit)).all()
        return [HistoryEntry(r.id, r.at_ms, r.who, r.action, r.target, r.detail) for r in reversed(rows)]

    def last_history_id(self) -> int:
        t = history_table
        with self._store.transaction("read the history") as conn:
            return int(conn.scalar(sa.select(sa.func.max(t.c.id))) or 0)
