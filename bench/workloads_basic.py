"""W1 publish throughput, W2 drain of that backlog, W3 end-to-end latency at a fixed rate."""

from __future__ import annotations

from typing import Any

from bench.cell import Cell, require_ok
from bench.stats import histogram_delta

# Slowest rate we still wait for, to turn a message count into a worker time limit.
SLOWEST_MSGS_PER_S = 2_000


def w1_publish(cell: Cell, family: str) -> dict[str, Any]:
    """Acknowledged publish of w1_messages with no consumer running: builds W2's backlog."""
    n = cell.settings.w1_messages
    subjects = [family]
    limit_s = cell.worker_limit_s(n / SLOWEST_MSGS_PER_S)
    producer = cell.spawn(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="bulk", messages=n, wait_go=True, setup=True))
    cell.ready(producer)
    monitor = cell.monitor()
    monitor.start()
    producer.go()
    result = require_ok(producer.result(limit_s + 10.0), "producer")
    return {**result, "server": monitor.stop(n)}


def w2_drain(cell: Cell, family: str) -> dict[str, Any]:
    """Consume and ack W1's backlog (same family) as fast as possible."""
    n = cell.settings.w1_messages
    limit_s = cell.worker_limit_s(n / SLOWEST_MSGS_PER_S)
    consumer = cell.spawn(f"{family}-drain", cell.spec(
        "consumer", family, [family], limit_s, mode="drain", messages=n, wait_go=True, subscribe_after_go=True))
    cell.ready(consumer)
    monitor = cell.monitor()
    monitor.start()
    consumer.go()
    result = require_ok(consumer.result(limit_s + 10.0), "consumer")
    if result.get("received_unique", 0) < n:
        result["ok"] = False
        result["error"] = f"drained {result.get('received_unique')} of {n} before the deadline"
    return {**result, "server": monitor.stop(n)}


def w3_latency(cell: Cell, family: str) -> dict[str, Any]:
    """A paced producer and a subscribed consumer; latency from the stamps in each message."""
    s = cell.settings
    n = int(s.w3_rate_per_s * s.w3_duration_s)
    subjects = [family]
    limit_s = cell.worker_limit_s(s.w3_duration_s)
    consumer = cell.spawn(f"{family}-consumer", cell.spec(
        "consumer", family, subjects, limit_s + 10.0, mode="latency", messages=n, setup=True))
    cell.ready(consumer)
    producer = cell.spawn(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="paced", rate_per_s=s.w3_rate_per_s,
        duration_s=s.w3_duration_s, wait_go=True))
    try:
        cell.ready(producer)
    except Exception:
        consumer.kill()
        raise
    monitor = cell.monitor()
    monitor.start()
    fsyncs_before = cell.server.fsync_seconds_counts()
    producer.go()
    produced = producer.result(limit_s + 10.0)
    consumed = consumer.result(limit_s + 20.0)
    server = monitor.stop(n)
    require_ok(produced, "producer")
    require_ok(consumed, "consumer")
    fsyncs_after = cell.server.fsync_seconds_counts()
    return {
        "ok": consumed.get("missing", 0) == 0,
        # the server's fsyncs during the cell by duration (its own histogram; qmq only)
        "server_fsync_le_s": histogram_delta(fsyncs_before, fsyncs_after),
        "achieved_rate_per_s": produced.get("achieved_rate_per_s"),
        "max_producer_lag_ms": produced.get("max_producer_lag_ms"),
        "latency_ms": consumed.get("latency_ms"),
        "latency_from_schedule_ms": consumed.get("latency_from_schedule_ms"),
        "latency_by_send_second": consumed.get("latency_by_send_second"),
        "missing": consumed.get("missing"),
        "duplicates": consumed.get("duplicates"),
        "server_version": produced.get("server_version"),
        "client": produced.get("client"),
        "server": server,
    }
