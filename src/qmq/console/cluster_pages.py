"""The cluster page (``/console/``): groups with their roles, epochs and write states, every
server with its disk, from what ``qmq cluster status`` and ``qmq top`` read (the meta server's
``GET /meta/cluster`` and each server's ``/metrics``)."""

from __future__ import annotations

from typing import Any

import aiohttp
from aiohttp import web

from qmq.console.base import Console

_TIMEOUT_S = 5.0


async def cluster(console: Console, request: web.Request) -> web.StreamResponse:
    from qmq.cli.top_commands import take_snapshot, view

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S)) as http:
        snap = await take_snapshot(http, console.meta_server, with_delay=False)
    doc = view(snap, None)
    machines = {s["address"]: s for s in doc["servers"]}
    servers: list[dict[str, Any]] = []
    for s in snap.cluster.get("servers", []):
        seen = machines.get(s["address"], {})
        free, total = seen.get("disk_free_bytes"), seen.get("disk_total_bytes")
        used_percent = None if not total or free is None else round(100 * (total - free) / total, 1)
        servers.append(
            {
                **s,
                "disk_free_bytes": free,
                "disk_total_bytes": total,
                "disk_used_percent": used_percent,
                "metrics_error": seen.get("error"),
            }
        )
    return console.render(
        "cluster.html",
        title="Cluster",
        active="cluster",
        meta=snap.cluster.get("meta", {}),
        groups=snap.cluster.get("groups", []),
        servers=servers,
        now_ms=int(snap.cluster.get("time_ms", 0)),
        routes_total=int(snap.cluster.get("subjects_total", 0)),
    )
