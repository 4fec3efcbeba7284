"""W9 fan-out: one subject read by `fanout_groups` consumer groups, each reading every message
(RabbitMQ: a fanout exchange to a quorum queue per group; NATS: a durable consumer per group on
one stream; Redis: the groups on one stream; qmq: the groups of one subject). One consumer
process reads every group. Drained: the backlog is published first, then every group drains it;
live: a paced producer while every group consumes, latency per delivery.

W15 is the same at `fanout_wide_groups` (700) groups, with fewer messages and a tenth of the
live rate: the same deliveries per second as W9's live part."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from bench.cell import Cell, require_ok, timed
from bench.workloads_basic import SLOWEST_MSGS_PER_S


@dataclass(frozen=True)
class Shape:
    """A fan-out cell's size: groups, messages drained by each, prefetch per group, live rate."""

    groups: int
    messages: int
    prefetch: int
    live_rate_per_s: float


def narrow(cell: Cell) -> Shape:
    s = cell.settings
    return Shape(s.fanout_groups, s.fanout_messages, s.fanout_prefetch_per_group, s.fanout_live_rate_per_s)


def wide(cell: Cell) -> Shape:
    s = cell.settings
    return Shape(s.fanout_wide_groups, s.fanout_wide_messages, s.fanout_wide_prefetch_per_group,
                 s.fanout_wide_live_rate_per_s)


def _knobs(shape: Shape) -> dict[str, Any]:
    return {"groups": shape.groups, "prefetch": shape.prefetch, "recv_max": shape.prefetch * shape.groups}


def fanout_drained(cell: Cell, family: str, shape: Shape) -> dict[str, Any]:
    n, groups = shape.messages, shape.groups
    deliveries = n * groups
    limit_s = cell.worker_limit_s(deliveries / SLOWEST_MSGS_PER_S)
    published, publish_server = cell.run_one(f"{family}-producer", cell.spec(
        "producer", family, [family], limit_s, kind="bulk", messages=n, wait_go=True, setup=True, **_knobs(shape)),
        limit_s, n)
    drained, server = cell.run_one(f"{family}-drain", cell.spec(
        "consumer", family, [family], limit_s, mode="drain", messages=deliveries, wait_go=True,
        subscribe_after_go=True, **_knobs(shape)), limit_s, deliveries)
    received = drained.get("received_unique", 0)
    return {
        "ok": received >= deliveries,
        "messages": n,
        "groups": groups,
        "setup_s": published.get("setup_s"),
        "publish_msgs_per_s": published.get("msgs_per_s"),
        "publish_server": publish_server,
        "deliveries": received,
        "deliveries_per_s": drained.get("msgs_per_s"),
        "duplicates": drained.get("duplicates"),
        "fanout": drained.get("fanout"),
        "server": server,
        **({} if received >= deliveries else {"error": f"delivered {received} of {deliveries} before the deadline"}),
    }


def fanout_live(cell: Cell, family: str, shape: Shape) -> dict[str, Any]:
    s = cell.settings
    groups = shape.groups
    n = int(shape.live_rate_per_s * s.fanout_live_duration_s)
    deliveries = n * groups
    limit_s = cell.worker_limit_s(s.fanout_live_duration_s + deliveries / SLOWEST_MSGS_PER_S / 10)
    consumer = cell.spawn(f"{family}-consumer", cell.spec(
        "consumer", family, [family], limit_s + 10.0, mode="latency", messages=deliveries, setup=True,
        **_knobs(shape)))
    cell.ready(consumer)
    producer = cell.spawn(f"{family}-producer", cell.spec(
        "producer", family, [family], limit_s, kind="paced", rate_per_s=shape.live_rate_per_s,
        duration_s=s.fanout_live_duration_s, wait_go=True, groups=groups))
    try:
        cell.ready(producer)
    except Exception:
        consumer.kill()
        raise
    monitor = cell.monitor()
    monitor.start()
    producer.go()
    produced = producer.result(limit_s + 10.0)
    consumed = consumer.result(limit_s + 20.0)
    server = monitor.stop(deliveries)
    require_ok(produced, "producer")
    require_ok(consumed, "consumer")
    missing = consumed.get("missing", 0)
    return {
        "ok": missing == 0,
        "rate_per_s": shape.live_rate_per_s,
        "achieved_rate_per_s": produced.get("achieved_rate_per_s"),
        "max_producer_lag_ms": produced.get("max_producer_lag_ms"),
        "deliveries": consumed.get("received_unique"),
        "latency_ms": consumed.get("latency_ms"),
        "latency_from_schedule_ms": consumed.get("latency_from_schedule_ms"),
        "fanout": consumed.get("fanout"),
        "missing": missing,
        "server": server,
        **({} if missing == 0 else {"error": f"{missing} of {deliveries} deliveries missing at the deadline"}),
    }


def _fanout(cell: Cell, family: str, shape: Shape, workload: str) -> dict[str, Any]:
    """Drained, then live, each on a family of its own."""
    drained = timed(lambda: fanout_drained(cell, f"{family}d", shape))
    cell.log(f"    {workload} drained: {drained.get('deliveries_per_s')} deliveries/s ({drained.get('error', 'ok')})")
    live = timed(lambda: fanout_live(cell, f"{family}l", shape))
    cell.log(f"    {workload} live: p99 {(live.get('latency_ms') or {}).get('p99')} ms ({live.get('error', 'ok')})")
    errors = [f"{part}: {r.get('error')}" for part, r in (("drained", drained), ("live", live)) if not r.get("ok")]
    return {"ok": not errors, "groups": shape.groups, "drained": drained, "live": live,
            **({"error": "; ".join(errors)} if errors else {})}


def w9_fanout(cell: Cell, family: str) -> dict[str, Any]:
    return _fanout(cell, family, narrow(cell), "W9")


def w15_fanout_wide(cell: Cell, family: str) -> dict[str, Any]:
    return _fanout(cell, family, wide(cell), "W15")
