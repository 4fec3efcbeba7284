"""Disk faults. **Full disk**: the broker's and the delay server's data directories are small
tmpfs mounts, filled under load (first below ``disk_free_bytes_min``, then to the last byte) and
freed again. **Failing disk**: EIO or ENOSPC on a write, read or fsync of a chosen file kind,
through the store's fault seam (QMQ_FAULT_PLAN); a server that can no longer tell what is
durable says so on /health and is restarted, as an operator would."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chaos.checker import History
from chaos.cluster import ChaosCluster
from chaos.faults import PlanFile
from chaos.mounts import fill, free, tmpfs
from chaos.scenario import Result, Settings, drain
from qmq.common.limits import MiB
from qmq.testing import health

DISK_BYTES = 24 * MiB
FREE_BYTES_MIN = 4 * MiB
RESUME_TIMEOUT_S = 60.0


def run(settings: Settings) -> list[Result]:
    return [full_disk(settings), failing_disk(settings)]


def _first_ack_after(cluster: ChaosCluster, since_ms: int, timeout_s: float) -> float | None:
    """Seconds from ``since_ms`` until a send (not an outbox commit) was acknowledged, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        h = History()
        h.read_files(cluster.histories())
        after = [ms for mid, ms in h.acked.items() if ms > since_ms and h.kinds.get(mid, ("", 0))[0] != "tx"]
        if after:
            return (min(after) - since_ms) / 1000
        time.sleep(0.2)  # the producer's acks are only in its history file
    return None


def full_disk(settings: Settings) -> Result:
    result = Result(
        "full disk",
        "the data directories of a broker and a delay server on 24 MiB tmpfs mounts, filled to below "
        "disk_free_bytes_min and then to the last byte under load, then freed",
    )
    root = settings.work_dir / "full-disk"
    cluster = ChaosCluster(
        root,
        broker_groups=1,
        slaves=0,
        extra_config={section: {"disk_free_bytes_min": FREE_BYTES_MIN} for section in ("broker", "delay")},
    )
    cycles = 1 if settings.quick else 3
    t0 = time.monotonic()
    with contextlib.ExitStack() as mounts:
        try:
            dirs = [mounts.enter_context(tmpfs(root / name, DISK_BYTES)) for name in ("b1-m", "d1")]
            mounts.callback(cluster.close)
            cluster.start()
            cluster.start_load()
            time.sleep(3)
            for cycle in range(cycles):
                for leave in (2 * MiB, 0):  # below the minimum: refused; then nothing left at all
                    for d in dirs:
                        fill(d, leave)
                    result.fault_count += 1
                    time.sleep(4)
                for d in dirs:
                    free(d)
                freed_ms = time.time_ns() // 1_000_000
                took = _first_ack_after(cluster, freed_ms, RESUME_TIMEOUT_S)
                if took is None:
                    raise AssertionError(
                        f"cycle {cycle + 1}: no send acknowledged {RESUME_TIMEOUT_S:.0f} s after freeing space"
                    )
                result.recovery_s = max(result.recovery_s, took)
                time.sleep(2)
            result.figures = drain(cluster, settings.log)
            result.notes.append(f"{result.figures.unanswered_sends} sends not acknowledged (refused while full)")
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
    result.duration_s = time.monotonic() - t0
    return result


def _rule(op: str, path: str, errno: str, times: int) -> dict[str, Any]:
    return {"op": op, "path": path, "errno": errno, "times": times}


# (what, which process, rules with {dir} for its data directory)
FAILURES: list[tuple[str, str, list[dict[str, Any]]]] = [
    ("fsync EIO, broker message log", "b1-m", [_rule("fsync", "{dir}/log/*.log", "EIO", 1)]),
    ("write EIO, broker message log", "b2-m", [_rule("write", "{dir}/log/*.log", "EIO", 1)]),
    ("write ENOSPC, broker message log", "b1-m", [_rule("write", "{dir}/log/*.log", "ENOSPC", 5)]),
    ("read EIO, broker message log", "b2-m", [_rule("read", "{dir}/log/*.log", "EIO", 5)]),
    ("fsync EIO, broker action log", "b1-m", [_rule("fsync", "{dir}/action/*", "EIO", 1)]),
    ("fsync EIO, slave message log", "b2-s1", [_rule("fsync", "{dir}/log/*.log", "EIO", 1)]),
    ("fsync EIO, delay write-ahead log", "d1", [_rule("fsync", "{dir}/wal/*.log", "EIO", 1)]),
    ("write ENOSPC, delay write-ahead log", "d1", [_rule("write", "{dir}/wal/*.log", "ENOSPC", 5)]),
    ("fsync EIO, delay schedule log", "d1", [_rule("fsync", "{dir}/schedule/*", "EIO", 1)]),
    ("write EIO, checkpoint", "b2-m", [_rule("write", "{dir}/checkpoint*", "EIO", 1)]),
]


def _rules(rules: list[dict[str, Any]], data_dir: str) -> list[dict[str, Any]]:
    return [{**r, "path": r["path"].replace("{dir}", data_dir)} for r in rules]


@contextlib.contextmanager
def _plan(root: Path) -> Iterator[PlanFile]:
    root.mkdir(parents=True, exist_ok=True)
    yield PlanFile(root / "faults.json")


def failing_disk(settings: Settings) -> Result:
    result = Result(
        "failing disk",
        "EIO and ENOSPC on write, read and fsync of message, action, write-ahead and schedule logs and "
        "checkpoints (the store's fault seam, QMQ_FAULT_PLAN), under load",
        command="a server whose /health says its store failed: restart it with its command line",
    )
    root = settings.work_dir / "failing-disk"
    t0 = time.monotonic()
    restarts: list[str] = []
    with _plan(root) as plan:
        cluster = ChaosCluster(root, env=plan.env)
        try:
            cluster.start()
            cluster.start_load()
            faults = FAILURES[::3] if settings.quick else FAILURES
            for what, name, rules in faults:
                time.sleep(2)
                t_fault = time.monotonic()
                plan.set(_rules(rules, cluster.member(name).data_dir))
                time.sleep(2)
                plan.set([])
                result.fault_count += 1
                status, _body = health(cluster.http(name))
                if status != 200:  # the store failed: the operator restarts it
                    cluster.stop_member(name)
                    cluster.restart(name)
                    restarts.append(f"{name} after {what}")
                result.recovery_s = max(result.recovery_s, time.monotonic() - t_fault - 2)
            result.notes.append("restarted: " + ("; ".join(restarts) or "none"))
            result.figures = drain(cluster, settings.log)
        except Exception as exc:
            result.error = f"{type(exc).__name__}: {exc}"
        finally:
            cluster.close()
    result.duration_s = time.monotonic() - t0
    return result
