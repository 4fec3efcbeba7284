"""Read one sample of a running server's Prometheus ``/metrics`` (blocking; for tests)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def metric_value(http: str, sample: str, **labels: str) -> float:
    """The value of ``sample`` (as exposed, e.g. ``qmq_requests_total``) whose labels include
    ``labels``, from the server whose HTTP address is ``http`` (``host:port`` or a URL); 0 when
    it has none yet."""
    base = http if http.startswith("http") else f"http://{http}"
    with urllib.request.urlopen(base.rstrip("/") + "/metrics", timeout=5) as resp:
        text = resp.read().decode()
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return 0.0
