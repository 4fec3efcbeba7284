"""W6 elasticity (one consumer group drained by 1, 2, 4, 8 processes) and W7 many subjects."""

from __future__ import annotations

import os
import time
from typing import Any

from bench.cell import Cell, CellError, require_ok
from bench.tally import create_tally_file
from bench.workers import WorkerProcess
from bench.workloads_basic import SLOWEST_MSGS_PER_S


def _prepare(cell: Cell, cells: list[dict[str, Any]]) -> None:
    """Create the destinations of several cells and publish each its untimed backlog."""
    total = sum(item["messages"] for item in cells)
    limit_s = cell.worker_limit_s(total / SLOWEST_MSGS_PER_S)
    family = cells[0]["family"]
    worker = cell.spawn(f"{family}-prepare", cell.spec("prepare", family, [], limit_s, cells=cells))
    require_ok(worker.result(limit_s + 10.0), "backlog producer")


def _drain_with(
    cell: Cell, family: str, members: int, n: int, mode: str, prefetch: int, expected_s: float
) -> dict[str, Any]:
    """Start `members` consumer processes of one group on the family's backlog of n, release
    them together, and time until the last message of the backlog was handled."""
    tally_path = os.path.join(cell.log_dir, f"{cell.system}-{family}.tally")
    create_tally_file(tally_path, n, members)
    limit_s = cell.worker_limit_s(expected_s)
    consumers: list[WorkerProcess] = []
    try:
        for index in range(members):
            consumers.append(cell.spawn(f"{family}-c{index}", cell.spec(
                "consumer", family, [family], limit_s, mode=mode, messages=n, members=members, index=index,
                tally_path=tally_path, prefetch=prefetch, recv_max=min(prefetch, cell.settings.recv_max_messages),
                handler_sleep_ms=cell.settings.w6_handler_sleep_ms, wait_go=True, subscribe_after_go=True)))
        for consumer in consumers:
            cell.ready(consumer)
    except Exception:
        for consumer in consumers:
            consumer.kill()
        raise
    monitor = cell.monitor()
    monitor.start()
    go_ns = time.monotonic_ns()
    for consumer in consumers:
        consumer.go()
    results = [consumer.result(limit_s + 10.0) for consumer in consumers]
    server = monitor.stop(n)
    os.unlink(tally_path)
    for result in results:
        require_ok(result, "consumer")
    received = sum(r.get("received_unique", 0) for r in results)
    last_ns = max(r.get("last_ns", 0) for r in results)
    seconds = (last_ns - go_ns) / 1e9
    return {
        "ok": received >= n,
        "consumers": members,
        "received_unique": received,
        "duplicates": sum(r.get("duplicates", 0) for r in results),
        "per_consumer": [r.get("received_unique", 0) for r in results],
        "seconds": round(seconds, 3),
        "msgs_per_s": round(received / seconds, 1) if seconds > 0 else None,
        "server": server,
        **({} if received >= n else {"error": f"handled {received} of {n} before the deadline"}),
    }


def w6_elasticity(cell: Cell, family: str) -> dict[str, Any]:
    """Handler-bound (2 ms of simulated I/O per message, one at a time) drains by 1..8
    consumers, then the CPU-bound drain by 1 and 2 consumer processes."""
    s = cell.settings
    handler_msgs_per_s = 1000.0 / s.w6_handler_sleep_ms
    plan = [("handled", f"{family}h{m}", m, s.w6_messages, s.w6_prefetch) for m in s.w6_consumer_counts]
    plan += [("drain", f"{family}c{m}", m, s.w6_cpu_messages, s.prefetch_messages) for m in s.w6_cpu_consumer_counts]
    # Every backlog is published up front, by one process, before any drain is timed.
    _prepare(cell, [
        {"family": fam, "subjects": [fam], "members": members, "prefetch": prefetch, "messages": n}
        for _mode, fam, members, n, prefetch in plan
    ])
    handled: dict[str, Any] = {}
    cpu_bound: dict[str, Any] = {}
    for mode, fam, members, n, prefetch in plan:
        if mode == "handled":
            expected_s = n / (handler_msgs_per_s * members) * 2 + 10.0
            into, what = handled, "handler-bound"
        else:
            expected_s = n / SLOWEST_MSGS_PER_S
            into, what = cpu_bound, "CPU-bound"
        try:
            into[str(members)] = _drain_with(cell, fam, members, n, mode, prefetch, expected_s)
        except CellError as exc:
            into[str(members)] = {"ok": False, "error": str(exc)}
        cell.log(f"    W6 {what} x{members}: {into[str(members)].get('msgs_per_s')} msg/s")
    _add_speedups(handled)
    _add_speedups(cpu_bound)
    ok = all(r.get("ok") for r in [*handled.values(), *cpu_bound.values()])
    return {"ok": ok, "handler_bound": handled, "cpu_bound": cpu_bound,
            "handler_sleep_ms": s.w6_handler_sleep_ms, "prefetch": s.w6_prefetch}


def _add_speedups(by_members: dict[str, Any]) -> None:
    base = (by_members.get("1") or {}).get("msgs_per_s")
    for result in by_members.values():
        rate = result.get("msgs_per_s")
        result["speedup_vs_1"] = round(rate / base, 2) if base and rate else None


def w7_many_subjects(cell: Cell, family: str) -> dict[str, Any]:
    """w7_subjects subjects × w7_messages_per_subject: publish round-robin over the
    subjects in batches, then drain every subject with one consumer process."""
    s = cell.settings
    subjects = [f"{family}-{i:04d}" for i in range(s.w7_subjects)]
    n = s.w7_subjects * s.w7_messages_per_subject
    limit_s = cell.worker_limit_s(n / SLOWEST_MSGS_PER_S)
    # A batch never spans two subjects, so each subject gets exactly its share.
    batch = min(s.batch_messages, s.w7_messages_per_subject)
    producer = cell.spawn(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="bulk", messages=n, batch=batch, wait_go=True, setup=True))
    cell.ready(producer)
    monitor = cell.monitor()
    monitor.start()
    producer.go()
    published = require_ok(producer.result(limit_s + 10.0), "producer")
    publish_server = monitor.stop(n)
    consumer = cell.spawn(f"{family}-consumer", cell.spec(
        "consumer", family, subjects, limit_s, mode="drain", messages=n, wait_go=True, subscribe_after_go=True))
    cell.ready(consumer)
    monitor = cell.monitor()
    monitor.start()
    consumer.go()
    drained = require_ok(consumer.result(limit_s + 10.0), "consumer")
    drain_server = monitor.stop(n)
    received = drained.get("received_unique", 0)
    return {
        "ok": received >= n,
        "subjects": s.w7_subjects,
        "messages": n,
        "setup_s": published.get("setup_s"),
        "publish_msgs_per_s": published.get("msgs_per_s"),
        "drain_msgs_per_s": drained.get("msgs_per_s"),
        "received_unique": received,
        "publish_server": publish_server,
        "drain_server": drain_server,
        **({} if received >= n else {"error": f"drained {received} of {n} before the deadline"}),
    }
