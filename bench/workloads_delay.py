"""W4 delayed delivery spread over a window, and W5 the thundering second."""

from __future__ import annotations

import time
from typing import Any

from bench.cell import Cell, require_ok
from bench.monitor import ServerMonitor, total_rss_kib
from bench.stats import histogram_delta
from bench.workers import WorkerProcess

SLOWEST_SCHEDULE_MSGS_PER_S = 2_000


def _start_pair(
    cell: Cell, family: str, n: int, first_due_epoch_s: float | None, spread_s: float, limit_s: float
) -> tuple[WorkerProcess, WorkerProcess]:
    """A delayed-mode consumer that sets the cell up and subscribes, and a ready producer."""
    subjects = [family]
    consumer = cell.spawn(f"{family}-consumer", cell.spec(
        "consumer", family, subjects, limit_s + 10.0, mode="delayed", messages=n, delayed=True, setup=True))
    cell.ready(consumer)
    producer = cell.spawn(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="delayed", messages=n,
        first_due_epoch_s=first_due_epoch_s, spread_s=spread_s, wait_go=True))
    try:
        cell.ready(producer)
    except Exception:
        consumer.kill()
        raise
    return producer, consumer


def w4_delay(cell: Cell, family: str) -> dict[str, Any]:
    """w4_messages due uniformly over the next w4_spread_s: lateness, early deliveries, and
    the server memory that holding them costs."""
    s = cell.settings
    n = s.w4_messages
    limit_s = cell.worker_limit_s(s.w4_spread_s + n / SLOWEST_SCHEDULE_MSGS_PER_S)
    producer, consumer = _start_pair(cell, family, n, None, s.w4_spread_s, limit_s)
    monitor = ServerMonitor(cell.server.pids)
    monitor.start()
    holders = cell.server.delay_holder_pids
    rss_before_kib = total_rss_kib(holders())
    server_rss_before_kib = monitor.rss_now_kib()
    fired_before = cell.server.delay_lateness_counts()
    producer.go()
    produced = producer.result(limit_s + 10.0)
    rss_scheduled_kib = total_rss_kib(holders())
    server_rss_growth_kib = monitor.rss_now_kib() - server_rss_before_kib
    consumed = consumer.result(limit_s + 20.0)
    server = monitor.stop(n)
    require_ok(produced, "producer")
    if "skipped" in produced:
        consumer.kill()
        return {"skipped": produced["skipped"]}
    require_ok(consumed, "consumer")
    # of the messages the server handed on during the cell, how many within each bound (ms,
    # cumulative): the server's own share of the lateness, apart from the broker and the client
    fired = histogram_delta(fired_before, cell.server.delay_lateness_counts())
    # Messages already due when scheduling ended were (mostly) delivered, not held.
    held_fraction = max(0.0, 1.0 - produced["schedule_seconds"] / s.w4_spread_s)
    pending = round(n * held_fraction)
    rss_delta_bytes = (rss_scheduled_kib - rss_before_kib) * 1024
    return {
        "ok": consumed.get("missing", 0) == 0,
        "lateness_ms": consumed.get("lateness_ms"),
        "lateness_by_due_second": consumed.get("lateness_by_due_second"),
        "lateness_due_before_sent_ms": consumed.get("lateness_due_before_sent_ms"),
        "server_fire_lateness_le_ms": fired,
        "early_count": consumed.get("early_count"),
        "missing": consumed.get("missing"),
        "duplicates": consumed.get("duplicates"),
        "clamped_to_send_time": produced.get("clamped_to_send_time"),
        "schedule_msgs_per_s": produced.get("schedule_msgs_per_s"),
        "rss_before_mib": round(rss_before_kib / 1024, 1),
        "rss_all_scheduled_mib": round(rss_scheduled_kib / 1024, 1),
        "pending_when_scheduled_est": pending,
        "rss_bytes_per_pending": round(rss_delta_bytes / pending, 1) if pending else None,
        "server_rss_growth_mib": round(server_rss_growth_kib / 1024, 1),
        "poller": consumed.get("poller"),
        "server": server,
    }


def w5_thundering_second(cell: Cell, family: str) -> dict[str, Any]:
    """w5_messages all due within one second that starts w5_lead_s from now: how long
    until every one of them has been delivered."""
    s = cell.settings
    n = s.w5_messages
    limit_s = cell.worker_limit_s(s.w5_lead_s + 1.0 + n / SLOWEST_SCHEDULE_MSGS_PER_S)
    # The due second is fixed before the workers start, so their start-up eats into the lead.
    first_due_epoch_s = time.time() + s.w5_lead_s
    producer, consumer = _start_pair(cell, family, n, first_due_epoch_s, 1.0, limit_s)
    monitor = ServerMonitor(cell.server.pids)
    monitor.start()
    producer.go()
    produced = producer.result(limit_s + 10.0)
    consumed = consumer.result(limit_s + 20.0)
    server = monitor.stop(n)
    require_ok(produced, "producer")
    if "skipped" in produced:
        consumer.kill()
        return {"skipped": produced["skipped"]}
    require_ok(consumed, "consumer")
    last_ns = consumed.get("last_receipt_epoch_ns") or 0
    return {
        "ok": consumed.get("missing", 0) == 0,
        "seconds_until_all_delivered": round(last_ns / 1e9 - first_due_epoch_s, 3) if last_ns else None,
        "lateness_ms": consumed.get("lateness_ms"),
        "early_count": consumed.get("early_count"),
        "missing": consumed.get("missing"),
        "duplicates": consumed.get("duplicates"),
        "clamped_to_send_time": produced.get("clamped_to_send_time"),
        "schedule_seconds": produced.get("schedule_seconds"),
        "server": server,
    }
