"""W6 elasticity (one consumer group drained by 1, 2, 4, 8 processes) and W7 many subjects."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import time
from typing import Any

from bench.cell import READY_LIMIT_S, Cell, CellError, require_ok
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


@dataclasses.dataclass(frozen=True)
class Drain:
    """One W6 step: `members` consumers of one group drain `messages` of `family`."""

    mode: str  # "handled" or "drain"
    family: str
    members: int
    messages: int
    prefetch: int
    expected_s: float


def _round(cell: Cell, step: Drain, index: int) -> dict[str, Any]:
    return {
        "family": step.family, "subjects": [step.family], "limit_s": cell.worker_limit_s(step.expected_s),
        "mode": step.mode, "messages": step.messages, "members": step.members, "index": index,
        "tally_path": _tally_path(cell, step), "prefetch": step.prefetch,
        "recv_max": min(step.prefetch, cell.settings.recv_max_messages),
    }


def _tally_path(cell: Cell, step: Drain) -> str:
    return os.path.join(cell.log_dir, f"{cell.system}-{step.family}.tally")


def _drain(cell: Cell, pool: list[WorkerProcess], step: Drain) -> dict[str, Any]:
    """Release the first `members` consumers of the pool together and time until the last
    message of the step's backlog was handled."""
    members = pool[: step.members]
    for consumer in members:
        cell.ready(consumer)
    limit_s = cell.worker_limit_s(step.expected_s)
    monitor = cell.monitor()
    monitor.start()
    go_ns = time.monotonic_ns()
    for consumer in members:
        consumer.go()
    results = [consumer.next_result(limit_s + 10.0) for consumer in members]
    server = monitor.stop(step.messages)
    for result in results:
        require_ok(result, "consumer")
    n = step.messages
    received = sum(r.get("received_unique", 0) for r in results)
    seconds = (max(r.get("last_ns", 0) for r in results) - go_ns) / 1e9
    return {
        "ok": received >= n,
        "consumers": step.members,
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
    steps = [
        Drain("handled", f"{family}h{m}", m, s.w6_messages, s.w6_prefetch,
              s.w6_messages / (handler_msgs_per_s * m) * 2 + 10.0)
        for m in s.w6_consumer_counts
    ] + [
        Drain("drain", f"{family}c{m}", m, s.w6_cpu_messages, s.prefetch_messages,
              s.w6_cpu_messages / SLOWEST_MSGS_PER_S)
        for m in s.w6_cpu_consumer_counts
    ]
    # Every backlog is published up front, by one process, before any drain is timed.
    _prepare(cell, [
        {"family": st.family, "subjects": [st.family], "members": st.members, "prefetch": st.prefetch,
         "messages": st.messages}
        for st in steps
    ])
    for step in steps:
        create_tally_file(_tally_path(cell, step), step.messages, step.members)
    # One pool of consumer processes serves every step, consumer i taking part in the steps
    # with more than i members: the steps then pay a reconnect, not a process start.
    go_wait_s = sum(cell.worker_limit_s(st.expected_s) + READY_LIMIT_S for st in steps)
    pool = [
        cell.spawn(f"{family}-c{index}", cell.spec(
            "consumer", family, [], 0.0, handler_sleep_ms=s.w6_handler_sleep_ms, wait_go=True,
            subscribe_after_go=True, go_wait_s=go_wait_s,
            rounds=[_round(cell, st, index) for st in steps if st.members > index]))
        for index in range(max(st.members for st in steps))
    ]
    handled: dict[str, Any] = {}
    cpu_bound: dict[str, Any] = {}
    try:
        for step in steps:
            into, what = (handled, "handler-bound") if step.mode == "handled" else (cpu_bound, "CPU-bound")
            try:
                into[str(step.members)] = _drain(cell, pool, step)
            except CellError as exc:
                into[str(step.members)] = {"ok": False, "error": str(exc)}
            cell.log(f"    W6 {what} x{step.members}: {into[str(step.members)].get('msgs_per_s')} msg/s")
    finally:
        for worker in pool:
            worker.kill()
        for step in steps:
            with contextlib.suppress(OSError):
                os.unlink(_tally_path(cell, step))
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
    published, publish_server = cell.run_one(f"{family}-producer", cell.spec(
        "producer", family, subjects, limit_s, kind="bulk", messages=n, batch=batch, wait_go=True, setup=True),
        limit_s, n)
    drained, drain_server = cell.run_one(f"{family}-consumer", cell.spec(
        "consumer", family, subjects, limit_s, mode="drain", messages=n, wait_go=True, subscribe_after_go=True),
        limit_s, n)
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
