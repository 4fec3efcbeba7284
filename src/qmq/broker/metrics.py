"""The broker's Prometheus metrics, on a registry of its own (several brokers may share a process in tests).

Counters are bumped once per frame and subject, never per message. Lag and unacked counts
are read from the store when scraped.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from qmq.serving.connection import connection_counters
from qmq.store.broker_store import BrokerStore


class _ProgressCollector(Collector):
    def __init__(self, store: BrokerStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily]:
        backlog = GaugeMetricFamily(
            "qmq_consumer_lag_messages",
            "messages stored and not yet pulled by the group",
            labels=["subject", "group"],
        )
        unacked = GaugeMetricFamily(
            "qmq_consumer_unacked_messages",
            "messages pulled by the group and not yet acknowledged",
            labels=["subject", "group"],
        )
        consumers = GaugeMetricFamily("qmq_consumers", "consumers known per group", labels=["subject", "group"])
        for gp in list(self.store.progress.groups.values()):
            st = self.store.subjects.get(gp.subject)
            visible = st.visible_seq if st else 0
            backlog.add_metric([gp.subject, gp.group], max(0, visible - gp.pull_offset))
            unacked.add_metric([gp.subject, gp.group], sum(cp.unacked for cp in gp.consumers.values()))
            consumers.add_metric([gp.subject, gp.group], len(gp.consumers))
        yield backlog
        yield unacked
        yield consumers


class _StoreCollector(Collector):
    """The store's health and its bounded resources, read when scraped."""

    def __init__(self, store: BrokerStore) -> None:
        self.store = store

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        store = self.store
        yield GaugeMetricFamily(
            "qmq_store_failed", "1 once the store stopped taking writes until a restart", value=store.failed is not None
        )
        files = store.consume_files
        yield GaugeMetricFamily("qmq_consume_log_files_open", "consume-log files open now", value=len(files))
        yield GaugeMetricFamily("qmq_consume_log_files_max", "bound on open consume-log files", value=files.files_max)
        yield CounterMetricFamily(
            "qmq_consume_log_files_closed", "consume-log files closed to stay within the bound", value=files.closed
        )
        yield CounterMetricFamily(
            "qmq_consume_log_entries_repaired",
            "consume-log entries found damaged by a pull and rewritten from the message log",
            value=store.pulls.entries_repaired,
        )
        yield CounterMetricFamily(
            "qmq_damaged_records_skipped",
            "times a pull or read met a message-log record damaged on disk and left it out",
            value=store.pulls.damaged_records,
        )
        problems = store.redelivery_problems
        yield CounterMetricFamily(
            "qmq_redelivery_consumers_failed",
            "rounds in which a silent consumer's messages could not be moved to retry (tried again)",
            value=problems.consumers_failed,
        )
        yield CounterMetricFamily(
            "qmq_redelivery_messages_set_aside",
            "messages that could not be retried: dead-lettered with the reason, or skipped",
            value=problems.messages_set_aside,
        )


class _StoredCollector(Collector):
    """Messages and bytes stored per subject, from two numbers a subject (``BrokerMetrics.stored``):
    a labelled Counter child a subject costs over 1 KiB of memory, a list of two ints under 100 B,
    and a broker holds 40,000 subjects (issue 27)."""

    def __init__(self, stored: dict[str, list[int]]) -> None:
        self.stored = stored

    def collect(self) -> Iterator[CounterMetricFamily]:
        messages = CounterMetricFamily("qmq_messages_in", "messages stored", labels=["subject"])
        nbytes = CounterMetricFamily("qmq_bytes_in", "message bytes stored", labels=["subject"])
        for subject, (n, size) in list(self.stored.items()):
            messages.add_metric([subject], n)
            nbytes.add_metric([subject], size)
        yield messages
        yield nbytes


class _ConsumedCollector(Collector):
    """Messages and bytes delivered and messages acknowledged per (subject, group), from three
    numbers a group (``BrokerMetrics.delivered``, ``acked``): a PULL_MANY of 70 groups counted
    them through labelled Counter children, 4 µs a group for the label lookups alone, and each
    child costs over 1 KiB where the three numbers cost about 100 B."""

    def __init__(self, consumed: dict[tuple[str, str], list[int]]) -> None:
        self.consumed = consumed

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["subject", "group"]
        messages = CounterMetricFamily("qmq_messages_out", "messages delivered by pulls", labels=labels)
        nbytes = CounterMetricFamily("qmq_bytes_out", "record bytes delivered by pulls", labels=labels)
        acked = CounterMetricFamily("qmq_acked_messages", "messages acknowledged", labels=labels)
        for (subject, group), (n, size, acks) in list(self.consumed.items()):
            messages.add_metric([subject, group], n)
            nbytes.add_metric([subject, group], size)
            acked.add_metric([subject, group], acks)
        yield messages
        yield nbytes
        yield acked


class BrokerMetrics:
    def __init__(self, store: BrokerStore) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        # messages and bytes stored, by subject (_StoredCollector)
        self._in: dict[str, list[int]] = {}
        r.register(_StoredCollector(self._in))
        # messages and bytes delivered and messages acked, by subject and group (_ConsumedCollector)
        self._consumed: dict[tuple[str, str], list[int]] = {}
        r.register(_ConsumedCollector(self._consumed))
        self.duplicates = Counter("qmq_duplicates", "messages dropped by the duplicate window", registry=r)
        self.refused = Counter("qmq_messages_refused", "messages of a send refused", ["status"], registry=r)
        self.requests = Counter("qmq_requests", "requests by command", ["command"], registry=r)
        pulls = Counter("qmq_pulls", "pull requests answered, by outcome", ["outcome"], registry=r)
        self.pulls_with_messages = pulls.labels("messages")
        self.pulls_empty = pulls.labels("empty")
        self.connections = Gauge("qmq_connections", "open client connections", registry=r)
        self.connections_refused, self.connections_dropped = connection_counters("qmq", r)
        self.flush_seconds = Histogram(
            "qmq_store_flush_seconds",
            "time of one fdatasync of the message and action logs",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )
        self.waiting_pulls = Gauge("qmq_waiting_pulls", "long polls parked until messages arrive", registry=r)
        held = Gauge("qmq_held_messages", "messages stored ahead of their due time, not yet visible", registry=r)
        held.set_function(lambda: len(store.held))
        r.register(_ProgressCollector(store))
        r.register(_StoreCollector(store))

    def stored(self, per_subject: dict[str, list[int]]) -> None:
        stored = self._in
        for subject, (n, nbytes) in per_subject.items():
            pair = stored.get(subject)
            if pair is None:
                stored[subject] = [n, nbytes]
            else:
                pair[0] += n
                pair[1] += nbytes

    def delivered(self, subject: str, group: str, messages: int, nbytes: int) -> None:
        counts = self._consumed.get((subject, group))
        if counts is None:
            self._consumed[(subject, group)] = [messages, nbytes, 0]
        else:
            counts[0] += messages
            counts[1] += nbytes

    def acked(self, subject: str, group: str, messages: int) -> None:
        counts = self._consumed.get((subject, group))
        if counts is None:
            self._consumed[(subject, group)] = [0, 0, messages]
        else:
            counts[2] += messages

    def render(self) -> bytes:
        return generate_latest(self.registry)
