"""W10, 40,000 subjects: one process makes the subjects chunk by chunk and sends each its first
message (the rate at which new subjects are made), the server's memory per subject by role
while they sit idle, one consumer drains them all, then the server restarts on the data it holds
(time until it serves again) and, for qmq, `qmq subjects` lists them.

A system that cannot hold that many is reported with where it stopped and why: the grower
stops at its time limit, at the first error, or when the server's memory passes
many_subjects_server_rss_max_mib (the machine is shared; nothing may eat it)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import threading
import time
from typing import Any

from bench.cell import Cell, CellError, require_ok
from bench.monitor import total_rss_kib
from bench.servers import StartError
from bench.workloads_basic import SLOWEST_MSGS_PER_S

SETTLE_S = 2.0
LISTING_LIMIT_S = 300.0
# the drain of one message per subject is slower per message than a backlog's
SLOWEST_DRAIN_PER_S = SLOWEST_MSGS_PER_S / 20
DRAIN_GRACE_S = 120.0


def _rss_by_role(cell: Cell) -> dict[str, int]:
    return {role: total_rss_kib(pids) for role, pids in cell.server.role_pids().items()}


def per_subject_bytes(before_kib: dict[str, int], after_kib: dict[str, int], subjects: int) -> dict[str, int | None]:
    """RSS growth per subject by role, in bytes (None without subjects)."""
    return {role: (round((after_kib[role] - before_kib.get(role, 0)) * 1024 / subjects) if subjects else None)
            for role in after_kib}


def _watch_rss(cell: Cell, stop_path: str, cap_mib: int, done: threading.Event, seen: dict[str, Any]) -> None:
    """Create stop_path (the grower stops before its next chunk) once the server passes cap_mib."""
    while not done.wait(0.5):
        mib = total_rss_kib(cell.server.pids()) / 1024
        seen["peak_mib"] = max(seen.get("peak_mib", 0.0), mib)
        if mib > cap_mib and not os.path.exists(stop_path):
            seen["capped_at_mib"] = round(mib, 1)
            with open(stop_path, "w") as f:
                f.write(f"the server's RSS passed {cap_mib:,} MiB ({mib:,.0f} MiB)\n")


def _grow(cell: Cell, family: str) -> dict[str, Any]:
    s = cell.settings
    stop_path = os.path.join(cell.log_dir, f"{cell.system}-{family}.stop")
    grower = cell.spawn(f"{family}-grow", cell.spec(
        "grow", family, [], s.many_subjects_limit_s, subject_count=s.many_subjects, chunk=s.many_subjects_chunk,
        stop_path=stop_path))
    cell.ready(grower)
    done = threading.Event()
    seen: dict[str, Any] = {}
    watcher = threading.Thread(target=_watch_rss, args=(cell, stop_path, s.many_subjects_server_rss_max_mib,
                                                        done, seen), daemon=True)
    monitor = cell.monitor()
    monitor.start()
    watcher.start()
    grower.go()
    try:
        grown = require_ok(grower.result(cell.worker_limit_s(s.many_subjects_limit_s) + 30.0), "grower")
    finally:
        done.set()
        watcher.join(2.0)
        with contextlib.suppress(OSError):
            os.unlink(stop_path)
    return {**grown, "server": monitor.stop(grown.get("reached") or 0), "server_rss_capped_at_mib":
            seen.get("capped_at_mib")}


def _drain(cell: Cell, family: str, reached: int) -> dict[str, Any]:
    """One consumer of every subject; what it drained by its deadline (the driver waits longer, so
    a consumer whose last call outlasts its deadline still reports)."""
    limit_s = cell.worker_limit_s(reached / SLOWEST_DRAIN_PER_S)
    consumer = cell.spawn(f"{family}-drain", cell.spec(
        "consumer", family, [], limit_s, subject_count=reached, mode="drain", messages=reached, wait_go=True,
        subscribe_after_go=True))
    monitor = cell.monitor()
    try:
        cell.ready(consumer)
    except CellError as exc:
        return {"ok": False, "error": str(exc)}
    monitor.start()
    consumer.go()
    try:
        drained = require_ok(consumer.result(limit_s + DRAIN_GRACE_S), "consumer")
    except CellError as exc:
        return {"ok": False, "error": str(exc), "server": monitor.stop(reached)}
    received = drained.get("received_unique") or 0
    return {"ok": received >= reached, "received_unique": received, "msgs_per_s": drained.get("msgs_per_s"),
            "seconds": drained.get("seconds"), "seconds_to_first_msg": drained.get("seconds_to_first_msg"),
            "server": monitor.stop(reached),
            **({} if received >= reached else {"error": f"drained {received:,} of {reached:,} in {limit_s:.0f} s"})}


def _restart(cell: Cell) -> dict[str, Any]:
    """Stop the server and start it on the data it holds; on failure a fresh one, so the
    cells after this one still run."""
    stopping = time.monotonic()
    cell.server.stop()
    started = time.monotonic()
    try:
        cell.endpoint = cell.server.restart_keeping_data()
        cell.server.check_loopback_only()
        return {"ok": True, "stop_s": round(started - stopping, 2), "restart_s": round(time.monotonic() - started, 2),
                "rss_after_restart_mib": round(total_rss_kib(cell.server.pids()) / 1024, 1)}
    except StartError as exc:
        cell.server.stop()
        cell.endpoint = cell.server.start()
        return {"ok": False, "error": f"restart on its data failed: {exc}; started a fresh one"}


def _listing(cell: Cell) -> dict[str, Any] | None:
    """`qmq subjects` against the restarted standalone: its time and the subjects it printed."""
    meta = cell.endpoint.get("meta_server")
    if not cell.system.startswith("qmq-") or not meta:
        return None
    started = time.monotonic()
    try:
        out = subprocess.run([sys.executable, "-m", "qmq", "subjects", "--meta-server", meta],
                             capture_output=True, text=True, timeout=LISTING_LIMIT_S)
    except subprocess.TimeoutExpired:
        return {"ok": False, "error": f"qmq subjects gave no answer in {LISTING_LIMIT_S:.0f} s"}
    seconds = round(time.monotonic() - started, 2)
    if out.returncode != 0:
        return {"ok": False, "seconds": seconds, "error": (out.stderr.strip().splitlines() or ["?"])[-1][:300]}
    return {"ok": True, "seconds": seconds, "subjects_listed": len(out.stdout.splitlines())}


def w10_many_subjects(cell: Cell, family: str) -> dict[str, Any]:
    s = cell.settings
    time.sleep(SETTLE_S)
    before = _rss_by_role(cell)
    grown = _grow(cell, family)
    reached = grown.get("reached") or 0
    time.sleep(SETTLE_S)
    idle = _rss_by_role(cell)
    result: dict[str, Any] = {
        "asked": s.many_subjects,
        "reached": reached,
        "stopped": grown.get("stopped"),
        "new_subjects_per_s": grown.get("new_subjects_per_s"),
        "grow": grown,
        "rss_before_kib": before,
        "rss_idle_kib": idle,
        "rss_bytes_per_subject": per_subject_bytes(before, idle, reached),
    }
    cell.log(f"    W10 grow: {reached:,} of {s.many_subjects:,} subjects, {grown.get('new_subjects_per_s')} new/s; "
             f"stopped: {grown.get('stopped')}")
    if reached:
        result["drain"] = _drain(cell, family, reached)
    result["restart"] = _restart(cell) if s.many_subjects_restart else {"ok": True, "skipped": "not in quick runs"}
    listing = _listing(cell)
    if listing is not None:
        result["listing"] = listing
    errors = [] if reached else [f"no subject made: {grown.get('stopped')}"]
    if reached and not result["drain"].get("ok"):
        errors.append(f"drain: {result['drain'].get('error')}")
    if not result["restart"].get("ok"):
        errors.append(result["restart"]["error"])
    if listing is not None and not listing.get("ok"):
        errors.append(f"qmq subjects: {listing.get('error')}")
    return {"ok": not errors, **result, **({"error": "; ".join(errors)} if errors else {})}
