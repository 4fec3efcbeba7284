"""docs/operations/: the Prometheus alert rules and the Grafana dashboard load, and every metric
they use is one that a live standalone's roles serve at /metrics."""

from __future__ import annotations

import json
import re
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from qmq.testing import ReadyProcess

ROOT = Path(__file__).resolve().parents[2]
OPERATIONS = ROOT / "docs" / "operations"
_METRIC = re.compile(r"\b(qmq_[a-z0-9_]+)\b")
_HISTOGRAM_SERIES = ("_bucket", "_sum", "_count")


def served_metrics(standalone: ReadyProcess) -> set[str]:
    """Every series name the broker, delay server and meta server declare at /metrics."""
    urls = [
        standalone.ready["broker_http"],
        standalone.ready["delay_http"],
        standalone.meta_server.removesuffix("/meta/address"),
    ]
    names: set[str] = set()
    for url in urls:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as answer:
            text = answer.read().decode("utf-8")
        for line in text.splitlines():
            if line.startswith("# TYPE "):
                _, _, name, kind = line.split(" ", 3)
                names.add(name)
                if kind == "histogram":
                    names.update(name + suffix for suffix in _HISTOGRAM_SERIES)
    return names


def rule_expressions() -> list[str]:
    doc: Any = yaml.safe_load((OPERATIONS / "prometheus-rules.yml").read_text(encoding="utf-8"))
    exprs = []
    for group in doc["groups"]:
        for rule in group["rules"]:
            assert rule["alert"], rule
            assert rule["labels"]["severity"] in ("warning", "critical"), rule
            assert rule["annotations"]["summary"], rule
            exprs.append(str(rule["expr"]))
    return exprs


def dashboard_expressions() -> list[str]:
    doc = json.loads((OPERATIONS / "grafana-dashboard.json").read_text(encoding="utf-8"))
    assert doc["uid"] == "qmq-overview"
    assert doc["panels"]
    return [t["expr"] for panel in doc["panels"] for t in panel["targets"]]


@pytest.mark.integration
def test_every_metric_of_the_alert_rules_and_the_dashboard_is_served(shared_standalone: ReadyProcess) -> None:
    served = served_metrics(shared_standalone)
    assert "qmq_consumer_lag_messages" in served
    files = {"prometheus-rules.yml": rule_expressions(), "grafana-dashboard.json": dashboard_expressions()}
    for source, exprs in files.items():
        assert len(exprs) >= 8, source
        for expr in exprs:
            used = _METRIC.findall(expr)
            assert used, f"{source}: {expr!r} uses no qmq metric"
            missing = [name for name in used if name not in served]
            assert missing == [], f"{source}: {expr!r} uses {missing}, which no role serves"
