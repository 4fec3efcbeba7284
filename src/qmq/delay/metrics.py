"""The delay server's Prometheus metrics, on a registry of its own.

Counters of sends are bumped once per frame; the backlog, the timer and the hand-over
figures are read from the store, the scheduler and the dispatcher when scraped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

from qmq.serving.connection import connection_counters

if TYPE_CHECKING:
    from qmq.delay.dispatcher import Dispatcher
    from qmq.delay.scheduler import Scheduler


class _StateCollector(Collector):
    def __init__(self, scheduler: Scheduler, dispatcher_of: Callable[[], Dispatcher | None]) -> None:
        self.scheduler = scheduler
        self.dispatcher_of = dispatcher_of  # none on a slave: it hands nothing over

    def collect(self) -> Iterator[Metric]:
        sched = self.scheduler
        store = sched.store
        store.flush_deferred()  # into their buckets' buffers: every bucket counted
        buckets = list(store.buckets.values())
        yield GaugeMetricFamily(
            "qmq_delay_pending_messages", "messages not yet handed to a broker", store.pending_total
        )
        yield GaugeMetricFamily("qmq_delay_buckets", "time buckets on disk", len(buckets))
        yield GaugeMetricFamily(
            "qmq_delay_loaded_buckets", "time buckets loaded into the timer", sum(1 for b in buckets if b.loaded)
        )
        yield GaugeMetricFamily("qmq_delay_timer_messages", "messages held in the in-memory timer", len(sched.timer))
        yield GaugeMetricFamily("qmq_delay_timer_bytes", "bytes of the timer's arrays", sched.timer.nbytes)
        yield GaugeMetricFamily(
            "qmq_delay_schedule_buffer_bytes",
            "bytes replayed and not yet written to schedule logs",
            store.buffered_bytes,
        )
        yield CounterMetricFamily(
            "qmq_delay_dispatch_entries_damaged",
            "dispatch-log entries that failed their CRC check (dropped: their messages are handed over again)",
            store.dispatch_entries_damaged,
        )
        d = self.dispatcher_of()
        if d is None:
            return
        yield GaugeMetricFamily("qmq_delay_handover_in_flight", "messages handed to brokers, unanswered", d.in_flight)
        yield CounterMetricFamily("qmq_delay_dispatched", "messages brokers acknowledged", d.dispatched_total)
        yield CounterMetricFamily(
            "qmq_delay_refused_by_broker", "due messages a broker refused for good (dropped)", d.refused_total
        )
        yield CounterMetricFamily(
            "qmq_delay_handover_failures", "hand-overs that failed and were retried", d.failures_total
        )
        yield CounterMetricFamily(
            "qmq_delay_corrupt_records", "schedule-log records that failed their check (skipped)", d.corrupt_total
        )
        counts = d.lateness_counts.tolist()
        running = 0
        cumulative = []
        for bound, c in zip([*map(str, d.lateness_bounds_ms()), "+Inf"], counts, strict=True):
            running += c
            cumulative.append((bound, running))
        yield HistogramMetricFamily(
            "qmq_delay_fire_lateness_ms",
            "hand-over time minus its planned time (due time - handover_lead_ms), milliseconds",
            buckets=cumulative,
            sum_value=d.lateness_sum_ms,
        )


class DelayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.messages_in = Counter("qmq_delay_messages_in", "delay messages stored", registry=r)
        self.bytes_in = Counter("qmq_delay_bytes_in", "bytes of delay messages stored", registry=r)
        self.refused = Counter("qmq_delay_messages_refused", "messages of a send refused", ["status"], registry=r)
        self.cancelled = Counter(
            "qmq_delay_cancelled_messages", "pending delay messages (copies) cancelled", registry=r
        )
        self.requests = Counter("qmq_delay_requests", "requests by command", ["command"], registry=r)
        self.connections = Gauge("qmq_delay_connections", "open client connections", registry=r)
        self.connections_refused, self.connections_dropped = connection_counters("qmq_delay", r)
        self.background_syncs = Counter(
            "qmq_delay_background_syncs",
            "background fsyncs of schedule logs written sync_bytes past their last one",
            registry=r,
        )
        self.flush_seconds = Histogram(
            "qmq_delay_wal_flush_seconds",
            "time of one fdatasync of the write-ahead log",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
            registry=r,
        )

    def watch(self, scheduler: Scheduler, dispatcher_of: Callable[[], Dispatcher | None]) -> None:
        self.registry.register(_StateCollector(scheduler, dispatcher_of))

    def render(self) -> bytes:
        return generate_latest(self.registry)
