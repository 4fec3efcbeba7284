"""W1 publish throughput, W2 drain of that backlog, W3 end-to-end latency at a fixed rate."""

from __future__ import annotations

import dataclasses
from typing import Any

from bench.cell import Cell, require_ok
from bench.settings import PAYLOAD_BYTES
from bench.stats import histogram_delta

# Slowest rate we still wait for, to turn a message count into a worker time limit.
SLOWEST_MSGS_PER_S = 2_000
SLOWEST_BYTES_PER_S = 4_000_000


@dataclasses.dataclass(frozen=True)
class Shape:
    """Messages and their size for W1/W2 (1 KiB by default; W11 runs the same cells with large
    bodies, batch, window and prefetch cut to keep about as many bytes in flight)."""

    messages: int
    body_bytes: int = PAYLOAD_BYTES
    batch: int | None = None
    window: int | None = None
    prefetch: int | None = None

    def limit_s(self, cell: Cell) -> float:
        seconds = max(self.messages / SLOWEST_MSGS_PER_S, self.messages * self.body_bytes / SLOWEST_BYTES_PER_S)
        return cell.worker_limit_s(seconds)

    def producer_knobs(self) -> dict[str, Any]:
        knobs: dict[str, Any] = {"body_bytes": self.body_bytes}
        if self.batch is not None:
            knobs["batch"] = self.batch
        if self.window is not None:
            knobs["window"] = self.window
        return knobs

    def consumer_knobs(self) -> dict[str, Any]:
        return {} if self.prefetch is None else {"prefetch": self.prefetch, "recv_max": self.prefetch}


def w1_publish(cell: Cell, family: str, shape: Shape | None = None) -> dict[str, Any]:
    """Acknowledged publish of w1_messages with no consumer running: builds W2's backlog."""
    shape = shape or Shape(cell.settings.w1_messages)
    n = shape.messages
    subjects = [family]
    limit_s = shape.limit_s(cell)
    result, server = cell.run_one(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="bulk", messages=n, wait_go=True, setup=True,
        **shape.consumer_knobs(), **shape.producer_knobs()), limit_s, n)
    return {**result, "server": server}


def w2_drain(cell: Cell, family: str, shape: Shape | None = None) -> dict[str, Any]:
    """Consume and ack W1's backlog (same family) as fast as possible."""
    shape = shape or Shape(cell.settings.w1_messages)
    n = shape.messages
    limit_s = shape.limit_s(cell)
    result, server = cell.run_one(f"{family}-drain", cell.spec(
        "consumer", family, [family], limit_s, mode="drain", messages=n, wait_go=True, subscribe_after_go=True,
        **shape.consumer_knobs()), limit_s, n)
    if result.get("received_unique", 0) < n:
        result["ok"] = False
        result["error"] = f"drained {result.get('received_unique')} of {n} before the deadline"
    if result.get("seconds"):
        result["MB_per_s"] = round(result.get("received_unique", 0) * shape.body_bytes / result["seconds"] / 1e6, 2)
    return {**result, "server": server}


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
