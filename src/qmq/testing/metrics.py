"""Read a running server's HTTP views for tests (blocking): one sample of its Prometheus
``/metrics``, its ``/health``."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any

from prometheus_client.parser import text_string_to_metric_families


def _url(http: str, path: str) -> str:
    base = http if http.startswith("http") else f"http://{http}"
    return base.rstrip("/") + path


def health(http: str) -> tuple[int, dict[str, Any]]:
    """The HTTP status (200, or 503 when it is not ok) and body of the server's ``/health``."""
    try:
        with urllib.request.urlopen(_url(http, "/health"), timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def metric_value(http: str, sample: str, **labels: str) -> float:
    """The value of ``sample`` (as exposed, e.g. ``qmq_requests_total``) whose labels include
    ``labels``, from the server whose HTTP address is ``http`` (``host:port`` or a URL); 0 when
    it has none yet."""
    with urllib.request.urlopen(_url(http, "/metrics"), timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0
