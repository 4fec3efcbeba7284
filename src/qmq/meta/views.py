"""The JSON the meta server answers with: ``GET /meta/address`` for clients, ``GET /meta/cluster``
for people and tools (``qmq cluster status``), and the heartbeat answer for servers.

Built from what the registry holds; nothing here reads the store or the clock itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from qmq.meta.decisions import ROLES, is_fresh, slaves_heartbeating
from qmq.meta.leader import Holder
from qmq.meta.registry import GroupView, Heartbeat
from qmq.meta.store import GroupRecord, ServerRecord


@dataclass(frozen=True, slots=True)
class MetaSelf:
    """Who answers: this meta server's lease owner name and URL, whether it leads, its settings."""

    owner: str
    url: str
    leading: bool
    heartbeat_timeout_ms: int
    auto_promote: bool
    route_groups: int


def heartbeat_json(answer: Heartbeat, heartbeat_ms: int) -> dict[str, Any]:
    truncate = None
    if answer.truncate is not None:
        truncate = {"message_offset": answer.truncate[0], "action_offset": answer.truncate[1]}
    return {
        "ok": True,
        "heartbeat_ms": heartbeat_ms,
        "role_in_group": answer.role_in_group,
        "epoch": answer.epoch,
        "master": answer.master,
        "slaves": answer.slaves,
        "slave_addresses": list(answer.slave_addresses),
        "truncate": truncate,
    }


def group_json(g: GroupView) -> dict[str, str]:
    return {"group": g.group, "address": g.address, "http": g.http, "state": g.state, "role": "master"}


def address_json(groups: dict[str, list[GroupView]], routes: dict[str, list[str]], refresh_ms: int) -> dict[str, Any]:
    return {
        "broker_groups": [group_json(g) for g in groups["broker"]],
        "delay_groups": [group_json(g) for g in groups["delay"]],
        "routes": routes,
        "refresh_ms": refresh_ms,
    }


def cluster_json(
    me: MetaSelf,
    now_ms: int,
    servers: list[ServerRecord],
    groups: list[GroupRecord],
    leader: Holder | None,
    routes: dict[str, list[str]],
    subjects_total: int,
) -> dict[str, Any]:
    """Every group and server, every route asked for, and which meta server leads."""
    timeout_ms = me.heartbeat_timeout_ms
    by_group: dict[tuple[str, str], list[ServerRecord]] = {}
    for s in servers:
        by_group.setdefault((s.role, s.group), []).append(s)
    rows = {(g.role, g.group): g for g in groups}
    masters: dict[tuple[str, str], ServerRecord] = {}
    for key, g in rows.items():
        for s in by_group.get(key, []):
            if s.address == g.master:
                masters[key] = s
    return {
        "time_ms": now_ms,
        "meta": {
            "url": me.url,
            "owner": me.owner,
            "leading": me.leading,
            "leader": None
            if leader is None or leader.expires_ms <= now_ms
            else {"owner": leader.owner, "url": leader.url, "expires_ms": leader.expires_ms},
            "heartbeat_timeout_ms": timeout_ms,
            "auto_promote": me.auto_promote,
            "route_groups": me.route_groups,
        },
        "groups": [
            _group_row(g, masters.get((g.role, g.group)), by_group.get((g.role, g.group), []), now_ms, timeout_ms)
            for g in groups
        ],
        "servers": [
            _server_row(s, rows.get((s.role, s.group)), masters.get((s.role, s.group)), now_ms, timeout_ms)
            for s in sorted(servers, key=lambda s: _server_order(s, rows.get((s.role, s.group))))
        ],
        "routes": routes,
        "subjects_total": subjects_total,
    }


def _server_order(s: ServerRecord, group: GroupRecord | None) -> tuple[int, str, bool, str]:
    """Brokers, then delay servers; by group; each group's master first."""
    return (
        ROLES.index(s.role) if s.role in ROLES else len(ROLES),
        s.group,
        not (group and group.master == s.address),
        s.address,
    )


def _state(server: ServerRecord | None, now_ms: int, timeout_ms: int) -> str:
    return "available" if server is not None and is_fresh(server, now_ms, timeout_ms) else "unavailable"


def _group_row(
    g: GroupRecord, master: ServerRecord | None, members: list[ServerRecord], now_ms: int, timeout_ms: int
) -> dict[str, Any]:
    return {
        "role": g.role,
        "group": g.group,
        "epoch": g.epoch,
        "master": g.master,
        "state": _state(master, now_ms, timeout_ms),
        "write_state": None if master is None else master.write_state,
        "slaves": slaves_heartbeating(g, members, now_ms, timeout_ms),
        "message_offset": g.message_offset,
        "action_offset": g.action_offset,
        "changed_at_ms": g.changed_at_ms,
        "changed_by": g.changed_by,
    }


def _server_row(
    s: ServerRecord, group: GroupRecord | None, master: ServerRecord | None, now_ms: int, timeout_ms: int
) -> dict[str, Any]:
    is_master = group is not None and group.master == s.address
    if is_master:
        lag: int | None = 0
    elif master is not None:
        lag = max(0, master.log_end - s.log_end)
    else:
        lag = None
    return {
        "role": s.role,
        "group": s.group,
        "role_in_group": "master" if is_master else "slave",
        "reported_role_in_group": s.role_in_group,
        "epoch": s.epoch,
        "address": s.address,
        "http": s.http,
        "pid": s.pid,
        "state": _state(s, now_ms, timeout_ms),
        "last_heartbeat_ms": s.last_heartbeat_ms,
        "registered_at_ms": s.registered_at_ms,
        "log_end": s.log_end,
        "action_end": s.action_end,
        "replicated_ms": s.replicated_ms,
        "lag": lag,
        "write_state": s.write_state,
    }
