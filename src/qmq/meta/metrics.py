"""The meta server's Prometheus metrics, each server with its own CollectorRegistry.

A registry per server (not prometheus_client's global one) lets several meta servers live
in one process, as they do in tests.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from qmq.meta.registry import ROLES, RegistryCounts

CONTENT_TYPE = CONTENT_TYPE_LATEST


class MetaMetrics:
    """Counters updated as requests arrive; gauges set from the registry at each scrape."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.http_requests = Counter(
            "qmq_meta_http_requests",
            "HTTP requests answered, by route path and status code",
            ["path", "status"],
            registry=self.registry,
        )
        self.registrations = Counter(
            "qmq_meta_registrations",
            "servers registered (first report of a process), by role",
            ["role"],
            registry=self.registry,
        )
        self.heartbeats = Counter(
            "qmq_meta_heartbeats",
            "heartbeats (later reports of a registered process), by role",
            ["role"],
            registry=self.registry,
        )
        self.groups = Gauge(
            "qmq_meta_groups",
            "groups with a master, by role and state",
            ["role", "state"],
            registry=self.registry,
        )
        self.subjects = Gauge("qmq_meta_subjects", "subjects routed to at least one group", registry=self.registry)
        self.routes = Gauge("qmq_meta_routes", "(subject, broker group) routes", registry=self.registry)
        self.promotions = Counter(
            "qmq_meta_promotions",
            "slaves made master by this meta server, by role and how (auto: master silent; manual)",
            ["role", "how"],
            registry=self.registry,
        )
        self.leader = Gauge(
            "qmq_meta_leader",
            "1 while this meta server holds the leader lease (it alone promotes), else 0",
            registry=self.registry,
        )
        # Labelled series exist from the start, so a scrape shows zeros, not absences.
        for role in ROLES:
            self.registrations.labels(role=role)
            self.heartbeats.labels(role=role)
            for how in ("auto", "manual"):
                self.promotions.labels(role=role, how=how)

    def render(self, counts: RegistryCounts) -> bytes:
        """The exposition text, with gauges taken from ``counts``."""
        for (role, state), n in counts.groups.items():
            self.groups.labels(role=role, state=state).set(n)
        self.subjects.set(counts.subjects)
        self.routes.set(counts.routes)
        return generate_latest(self.registry)
