"""``qmq top``: a live view of a cluster, refreshed every second, from what its servers already
serve — the meta server's ``GET /meta/cluster`` (which servers there are, and where their HTTP
ports are), each broker's and delay server's ``/metrics``, and each delay group's DELAY_STATS.

Rates (messages a second in and out, CPU) are the change of a counter between two refreshes
over the time between them; ``--once`` takes two snapshots ``--interval`` apart to have them.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import click
from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from qmq.cli.client_commands import meta_server_option
from qmq.cli.main import CommandError, cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console
from qmq.cli.push_commands import _base, _headers
from qmq.common.errors import QmqError

_TIMEOUT_S = 3.0
_BUCKETS_SHOWN = 6
# rows of each table on a terminal; --json has them all
_ROWS_SHOWN = 20
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

Labels = tuple[tuple[str, str], ...]


def parse_samples(text: str) -> dict[str, dict[Labels, float]]:
    """``{metric: {labels: value}}`` of Prometheus text; comments and odd lines are skipped."""
    out: dict[str, dict[Labels, float]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        pairs = _LABEL.findall(m.group(2) or "")
        labels = tuple(sorted((k, v.replace('\\"', '"').replace("\\\\", "\\")) for k, v in pairs))
        out.setdefault(m.group(1), {})[labels] = value
    return out


@dataclass
class Snapshot:
    """One refresh: the cluster view, each server's samples and each delay group's stats."""

    at_s: float
    cluster: dict[str, Any]
    samples: dict[str, dict[str, dict[Labels, float]]] = field(default_factory=dict)  # by server address
    errors: dict[str, str] = field(default_factory=dict)
    delay: dict[str, dict[str, Any]] = field(default_factory=dict)


async def _get(http: aiohttp.ClientSession, url: str) -> tuple[int, str]:
    async with http.get(url, headers=_headers()) as answer:
        return answer.status, await answer.text()


async def take_snapshot(http: aiohttp.ClientSession, meta_server: str, with_delay: bool = True) -> Snapshot:
    """Ask the meta server for its servers, then every server's /metrics at once."""
    import json

    base = _base(meta_server)
    try:
        status, text = await _get(http, f"{base}/meta/cluster")
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise CommandError(f"cannot reach the meta server at {base}: {exc or type(exc).__name__}") from None
    if status != 200:
        raise CommandError(f"the meta server at {base} answered {status} to GET /meta/cluster: {text[:200]}")
    snap = Snapshot(time.monotonic(), json.loads(text))
    scheme = "https" if base.startswith("https:") else "http"
    servers = [s for s in snap.cluster.get("servers", []) if s.get("http")]
    results = await asyncio.gather(
        *(_get(http, f"{scheme}://{s['http']}/metrics") for s in servers), return_exceptions=True
    )
    for server, result in zip(servers, results, strict=True):
        if isinstance(result, BaseException):
            snap.errors[server["address"]] = f"{type(result).__name__}: {result}"
        elif result[0] != 200:
            snap.errors[server["address"]] = f"/metrics answered {result[0]}"
        else:
            snap.samples[server["address"]] = parse_samples(result[1])
    if with_delay and any(g.get("role") == "delay" for g in snap.cluster.get("groups", [])):
        from qmq.cli.delay_commands import ask_every_delay_group

        try:
            answers = await ask_every_delay_group(meta_server, {"buckets_max": _BUCKETS_SHOWN})
        except QmqError as exc:
            snap.errors["delay"] = str(exc)
        else:
            snap.delay = {name: a for name, a in answers.items() if not isinstance(a, QmqError)}
    return snap


def _total(samples: Iterable[dict[str, dict[Labels, float]]], metric: str, *keys: str) -> dict[tuple[str, ...], float]:
    out: dict[tuple[str, ...], float] = {}
    for s in samples:
        for labels, value in s.get(metric, {}).items():
            d = dict(labels)
            key = tuple(d.get(k, "") for k in keys)
            out[key] = out.get(key, 0.0) + value
    return out


def _rate(now: float | None, before: float | None, seconds: float) -> float | None:
    if now is None or before is None or seconds <= 0:
        return None
    return max(0.0, now - before) / seconds  # a restart resets a counter: never a negative rate


def view(now: Snapshot, before: Snapshot | None) -> dict[str, Any]:
    """The document ``--json`` prints and the tables show."""
    dt = now.at_s - before.at_s if before is not None else 0.0
    cur = list(now.samples.values())
    old = list(before.samples.values()) if before is not None else []
    stored = _total(cur, "qmq_messages_in_total", "subject")
    stored_before = _total(old, "qmq_messages_in_total", "subject")
    out_now = _total(cur, "qmq_messages_out_total", "subject", "group")
    out_before = _total(old, "qmq_messages_out_total", "subject", "group")
    subjects: dict[str, dict[str, Any]] = {}
    for (subject,), n in stored.items():
        subjects[subject] = {
            "subject": subject,
            "stored_total": int(n),
            "in_per_s": _rate(n, stored_before.get((subject,)), dt) if before else None,
            "out_per_s": None if not before else 0.0,
        }
    groups: dict[tuple[str, ...], dict[str, Any]] = {}
    lag = _total(cur, "qmq_consumer_lag_messages", "subject", "group")
    unacked = _total(cur, "qmq_consumer_unacked_messages", "subject", "group")
    consumers = _total(cur, "qmq_consumers", "subject", "group")
    for key in sorted(set(lag) | set(unacked) | set(out_now)):
        subject, group = key
        rate = _rate(out_now.get(key), out_before.get(key), dt) if before else None
        groups[key] = {
            "subject": subject,
            "group": group,
            "lag": int(lag.get(key, 0)),
            "unacked": int(unacked.get(key, 0)),
            "consumers": int(consumers.get(key, 0)),
            "out_per_s": rate,
        }
        entry = subjects.setdefault(
            subject, {"subject": subject, "stored_total": 0, "in_per_s": 0.0 if before else None, "out_per_s": None}
        )
        if rate is not None:
            entry["out_per_s"] = (entry["out_per_s"] or 0.0) + rate
    servers = []
    for s in now.cluster.get("servers", []):
        mine = now.samples.get(s["address"], {})
        earlier = before.samples.get(s["address"], {}) if before is not None else {}

        def one(samples: dict[str, dict[Labels, float]], metric: str) -> float | None:
            values = samples.get(metric)
            return sum(values.values()) if values else None

        cpu = _rate(one(mine, "qmq_process_cpu_seconds_total"), one(earlier, "qmq_process_cpu_seconds_total"), dt)
        connections = one(mine, "qmq_connections")
        if connections is None:
            connections = one(mine, "qmq_delay_connections")
        servers.append(
            {
                "role": s["role"],
                "group": s["group"],
                "role_in_group": s.get("role_in_group"),
                "address": s["address"],
                "state": s.get("state"),
                "cpu_percent": None if cpu is None else round(cpu * 100, 1),
                "memory_bytes": _int(one(mine, "qmq_process_resident_memory_bytes")),
                "disk_free_bytes": _int(one(mine, "qmq_disk_free_bytes")),
                "disk_total_bytes": _int(one(mine, "qmq_disk_total_bytes")),
                "connections": _int(connections),
                "error": now.errors.get(s["address"]),
            }
        )
    delay = [
        {
            "group": name,
            "pending": a.get("pending"),
            "next_due_ms": a.get("next_due_ms"),
            "dispatched_last_minute": a.get("dispatched_last_minute"),
            "buckets": [{"start_ms": b["start_ms"], "pending": b["pending"]} for b in a.get("buckets", [])],
        }
        for name, a in sorted(now.delay.items())
    ]
    return {
        "time_ms": now.cluster.get("time_ms"),
        "interval_s": round(dt, 3) if before is not None else None,
        "subjects": sorted(subjects.values(), key=lambda e: e["subject"]),
        "groups": list(groups.values()),
        "delay": delay,
        "servers": servers,
    }


def _int(value: float | None) -> int | None:
    return None if value is None or math.isnan(value) else int(value)


def _num(value: float | None, digits: int = 0) -> str:
    return "–" if value is None else f"{value:,.{digits}f}"


def _bytes(value: int | None) -> str:
    if value is None:
        return "–"
    size = float(value)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if size < 1024 or unit == "TiB":
            return f"{size:,.0f} {unit}" if unit == "B" else f"{size:,.1f} {unit}"
        size /= 1024
    return f"{value} B"


def tables(doc: dict[str, Any]) -> list[Table]:
    subjects = Table("subject", "in/s", "out/s", "stored", title="subjects")
    for e in sorted(doc["subjects"], key=lambda e: -(e["in_per_s"] or 0))[:_ROWS_SHOWN]:
        subjects.add_row(e["subject"], _num(e["in_per_s"], 1), _num(e["out_per_s"], 1), _num(e["stored_total"]))
    groups = Table("subject", "group", "lag", "unacked", "consumers", "out/s", title="consumer groups")
    for g in sorted(doc["groups"], key=lambda g: -g["lag"])[:_ROWS_SHOWN]:
        groups.add_row(
            g["subject"], g["group"], _num(g["lag"]), _num(g["unacked"]), _num(g["consumers"]), _num(g["out_per_s"], 1)
        )
    delay = Table("delay group", "pending", "next buckets (start UTC: pending)", title="delay backlog")
    for d in doc["delay"]:
        buckets = ", ".join(
            f"{time.strftime('%H:%M:%S', time.gmtime(b['start_ms'] / 1000))}: {b['pending']:,}" for b in d["buckets"]
        )
        delay.add_row(d["group"], _num(d["pending"]), buckets or "–")
    servers = Table("role", "group", "address", "state", "CPU %", "memory", "disk free", "connections", title="servers")
    for s in doc["servers"]:
        servers.add_row(
            f"{s['role']} {s['role_in_group'] or ''}".strip(),
            s["group"],
            s["address"],
            s["state"] or "–" if s["error"] is None else f"error: {s['error']}",
            _num(s["cpu_percent"], 1),
            _bytes(s["memory_bytes"]),
            _bytes(s["disk_free_bytes"]),
            _num(s["connections"]),
        )
    return [subjects, groups, delay, servers]


@cli.command()
@meta_server_option
@click.option(
    "--interval",
    type=click.FloatRange(0.2, 60),
    default=1.0,
    show_default=True,
    help="seconds between refreshes (rates are over this time)",
)
@click.option("--count", type=click.IntRange(1, 1_000_000), default=None, help="stop after this many refreshes")
@click.option("--once", is_flag=True, help="print one refresh (two snapshots --interval apart) and exit")
@json_option("document", "one refresh: {time_ms, interval_s, subjects, groups, delay, servers}; with --once")
def top(meta_server: str, interval: float, count: int | None, once: bool, as_json: bool) -> None:
    """A live view of the cluster, like htop: messages/s in and out per subject, lag per consumer
    group, the delay backlog per time bucket, and each server's CPU, memory, disk and
    connections, refreshed every --interval. Ctrl-C stops it."""
    if as_json and not once:
        raise click.UsageError("--json prints one refresh: add --once")
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a live view ends
        asyncio.run(_top(meta_server, interval, 1 if once else count, once, as_json))


async def _top(meta_server: str, interval_s: float, count: int | None, once: bool, as_json: bool) -> None:
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as http:
        before = await take_snapshot(http, meta_server, with_delay=False)
        console = stdout_console()
        if once or not console.is_terminal:
            done = 0
            while count is None or done < count:
                await asyncio.sleep(interval_s)  # the refresh period
                now = await take_snapshot(http, meta_server)
                doc = view(now, before)
                if as_json:
                    echo_json(doc)
                else:
                    _print(console, doc)
                before = now
                done += 1
            return
        with Live(Group(*tables(view(before, None))), console=console, auto_refresh=False) as live:
            done = 0
            while count is None or done < count:
                await asyncio.sleep(interval_s)  # the refresh period
                now = await take_snapshot(http, meta_server)
                live.update(Group(*tables(view(now, before))), refresh=True)
                before = now
                done += 1


def _print(console: Console, doc: dict[str, Any]) -> None:
    for table in tables(doc):
        print_table(console, table)
