"""``qmq cluster status`` for people: the meta server's ``GET /meta/cluster`` answer as tables of
groups, servers and routes; with the cluster file of ``qmq cluster up``, each server's
process name and whether that process still runs."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from qmq.cli.cluster_launch import Cluster, Member, is_running
from qmq.cli.output import print_table

_NONE = "–"


def _age(now_ms: int, then_ms: int | None) -> str:
    if not then_ms:
        return "never"
    return f"{max(0, now_ms - then_ms) / 1000:.1f} s ago"


def _state(state: str) -> str:
    return "[green]available[/green]" if state == "available" else "[red]unavailable[/red]"


def _writes(state: str | None) -> str:
    colours = {"ok": "green", "read-only": "red", "degraded": "yellow", "disk-full": "red", "failed": "red"}
    return f"[{colours[state]}]{state}[/{colours[state]}]" if state in colours else _NONE


def render(console: Console, view: dict[str, Any], local: Cluster | None) -> None:
    now_ms = int(view["time_ms"])
    meta = view["meta"]
    leader = meta.get("leader")
    lead = _NONE if not leader else leader["url"] + (" (this one)" if meta.get("leading") else "")
    console.print(
        f"[bold]meta server[/bold] {meta['url']}  leader {lead}  "
        f"auto_promote {'on' if meta['auto_promote'] else 'off'}  "
        f"heartbeat timeout {meta['heartbeat_timeout_ms'] / 1000:g} s  route_groups {meta['route_groups']}",
        soft_wrap=True,
    )

    groups = Table("role", "group", "epoch", "master", "state", "writes", "slaves", "operation", title="groups")
    for g in view["groups"]:
        groups.add_row(
            g["role"],
            g["group"],
            str(g["epoch"]),
            g["master"],
            _state(g["state"]),
            _writes(g["write_state"]),
            str(g["slaves"]),
            _operation(g),
        )
    removed = view.get("removed_groups") or []
    if removed:
        groups.caption = "removed for good: " + ", ".join(f"{r['role']} {r['group']}" for r in removed)
    print_table(console, groups)

    by_pid: dict[int, Member] = {m.pid: m for m in local.members} if local else {}
    servers = Table(
        "role",
        "group",
        "role in group",
        "epoch",
        "address",
        "pid",
        "process",
        "state",
        "last heartbeat",
        "log end",
        "lag",
        "writes",
        title="servers",
    )
    seen: set[int] = set()
    masters = {(s["role"], s["group"]): s for s in view["servers"] if s["role_in_group"] == "master"}
    for s in view["servers"]:
        member = by_pid.get(s["pid"])
        if member is not None:
            seen.add(member.pid)
        role_in_group = s["role_in_group"]
        if s["reported_role_in_group"] != role_in_group:
            role_in_group += f" (reports {s['reported_role_in_group']})"
        servers.add_row(
            s["role"],
            s["group"],
            role_in_group,
            _NONE if s["epoch"] is None else str(s["epoch"]),
            s["address"],
            str(s["pid"]),
            _process(member),
            _state(s["state"]),
            _age(now_ms, s["last_heartbeat_ms"]),
            f"{s['log_end']:,}",
            _lag(s, masters.get((s["role"], s["group"]))),
            _writes(s["write_state"]),
        )
    for m in local.members if local else []:
        if m.role != "meta" and m.pid not in seen:
            servers.add_row(
                m.role,
                m.group or _NONE,
                m.role_in_group or _NONE,
                _NONE,
                _NONE,
                str(m.pid),
                _process(m),
                "[red]not registered[/red]",
                _NONE,
                _NONE,
                _NONE,
                _NONE,
            )
    print_table(console, servers)

    routes = Table("subject", "broker groups", title="routes")
    retired = view.get("routes_retired") or {}
    for subject, names in view["routes"].items():
        gone = set(retired.get(subject, ()))
        routes.add_row(subject, ", ".join(f"{n} (retiring)" if n in gone else n for n in names))
    shown, total = len(view["routes"]), int(view["subjects_total"])
    routes.caption = f"{shown:,} of {total:,} subject(s)" + ("; more with --routes N" if total > shown else "")
    print_table(console, routes)


def _lag(s: dict[str, Any], master: dict[str, Any] | None) -> str:
    """A slave's lag in bytes of the message log, and how much of its master's log it has copied
    (a new slave catching up shows its progress here)."""
    lag = s["lag"]
    if lag is None:
        return _NONE
    if s["role_in_group"] != "slave" or master is None or not master["log_end"] or not lag:
        return f"{lag:,}"
    percent = min(s["log_end"], master["log_end"]) * 100 // master["log_end"]  # never 100 while behind
    return f"{lag:,} ({percent}% copied)"


def _operation(g: dict[str, Any]) -> str:
    """writable, draining with what is left (the largest subject and consumer group), or drained."""
    state = g.get("operation")
    if state is None:
        return _NONE  # a meta server without operations
    if state == "writable":
        return "writable"
    if state == "drained":
        return "[green]drained[/green] (0 left)"
    left = g.get("left")
    if left is None:
        return "[yellow]draining[/yellow] (left: not reported)"
    top = g.get("left_top") or []
    biggest = ""
    if top:
        subject, consumer_group, n = top[0]
        biggest = f"; {n:,} of {subject} for {consumer_group or 'no consumer group'}"
    return f"[yellow]draining[/yellow] ({left:,} left{biggest})"


def _process(member: Member | None) -> str:
    if member is None:
        return _NONE
    return member.name if is_running(member) else f"{member.name} [red](gone)[/red]"


def render_processes(console: Console, local: Cluster) -> None:
    """The processes ``qmq cluster up`` started, from its cluster file (when the meta server is away)."""
    table = Table(
        "process", "role", "group", "role in group", "pid", "running", "log", title=f"processes of {local.data_dir}"
    )
    for m in local.members:
        table.add_row(
            m.name,
            m.role,
            m.group or _NONE,
            m.role_in_group or _NONE,
            str(m.pid),
            "yes" if is_running(m) else "[red]no[/red]",
            m.log,
        )
    print_table(console, table)
