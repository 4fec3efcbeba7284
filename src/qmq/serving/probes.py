"""``GET /health`` of every role: one body, three ways to read it.

The body carries ``ok`` (the role works), ``alive`` (the process serves: always true in an
answer) and ``ready`` (it has recovered and registered, so it may take traffic). A load balancer
or a Kubernetes probe picks what the status code follows with ``?probe=``:

- ``/health``: 200 when ``ok``, else 503 (as before);
- ``/health?probe=live``: 200 while the process answers (a liveness probe: restart it when not);
- ``/health?probe=ready``: 200 when ``ready``, else 503 (a readiness probe: route to it or not).
"""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

PROBES = ("live", "ready")


def probe_status(request: web.Request, body: Mapping[str, object]) -> int:
    """The status of a ``/health`` answer of ``body`` for the probe the request names; 400 for an
    unknown probe (the body then says which there are)."""
    probe = request.query.get("probe")
    if probe is None:
        return 200 if body.get("ok") else 503
    if probe == "live":
        return 200
    if probe == "ready":
        return 200 if body.get("ready") else 503
    return 400


def with_probe_error(request: web.Request, body: dict[str, object]) -> dict[str, object]:
    """``body``, with an error naming the probes when the request names another one."""
    probe = request.query.get("probe")
    if probe is not None and probe not in PROBES:
        body["error"] = f"probe={probe!r} is unknown; use probe=live or probe=ready (or none)"
    return body
