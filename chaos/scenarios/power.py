"""Power loss: the broker's and the delay server's data directories are LazyFS mounts
(chaos/lazyfs.py) that forget every write not fsynced when the power is cut: both servers are
killed with ``kill -9`` and their file systems unmounted (which undoes what was not durable),
then everything is mounted and started again. Under ``flush = "sync"`` no acknowledged send may
be lost; under ``periodic`` only sends acknowledged within ``flush_interval_ms`` before the cut
may be, and how many is reported. The sync run also writes the I/O trace (QMQ_IO_TRACE) and
checks no send and no ack was answered before the fsync covering it (qmq.store.trace_check).
An ack is answered once durable (under ``periodic``: fsynced within the interval), so nothing
may be delivered again to a group after its ack was answered, but what a cut may undo under
``periodic``: an ack answered within the interval before it, or a pull answered within it
(whose acks, made after the restart, name positions the broker no longer holds);
``chaos.checker.periodic_allowance`` counts those apart."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

from chaos.checker import History, periodic_allowance
from chaos.cluster import GROUPS, ChaosCluster
from chaos.scenario import Result, Settings, drain
from qmq.store.trace_check import check_file

SERVERS = ("b1-m", "d1")
PERIODIC_INTERVAL_MS = 1_000
# What a cut may undo also covers the fsync that follows the interval (its own duration).
FSYNC_MARGIN_MS = 100
MOUNT_TIMEOUT_S = 30.0


class Lazy:
    """One LazyFS mount: its daemon, its backing directory, its mount point."""

    def __init__(self, backing: Path, mount: Path, log: Path) -> None:
        self.backing, self.mount, self.log = backing, mount, log
        self.proc: subprocess.Popen[bytes] | None = None

    def up(self) -> None:
        self.backing.mkdir(parents=True, exist_ok=True)
        self.mount.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "chaos.lazyfs", str(self.backing), str(self.mount)],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out,
            )
        deadline = time.monotonic() + MOUNT_TIMEOUT_S
        while not os.path.ismount(self.mount):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"LazyFS did not mount {self.mount}: see {self.log}")
            time.sleep(0.05)  # a mount gives no event to wait on; polled with a deadline

    def cut(self) -> None:
        """The power cut: unmount; the daemon undoes what was not durable, then exits."""
        if self.proc is None:
            return
        for _ in range(50):
            if subprocess.run(["fusermount3", "-u", str(self.mount)], capture_output=True).returncode == 0:
                break
            time.sleep(0.1)  # the killed servers' files are still being released
        else:
            subprocess.run(["fusermount3", "-u", "-z", str(self.mount)], capture_output=True)
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None


def run(settings: Settings) -> list[Result]:
    return [_run(settings, "sync"), _run(settings, "periodic")]


def _run(settings: Settings, flush: str) -> Result:
    result = Result(
        f"power loss ({flush})",
        f"broker and delay server on LazyFS (unsynced writes dropped at the cut), flush = \"{flush}\": "
        "kill -9 of both, unmount, mount, start",
        command="start both again with their command lines",
    )
    root = settings.work_dir / f"power-{flush}"
    root.mkdir(parents=True, exist_ok=True)
    trace = root / "io-trace.tsv"
    extra = {"flush": flush, "flush_interval_ms": PERIODIC_INTERVAL_MS}
    env = {"QMQ_IO_TRACE": str(trace)} if flush == "sync" else {}
    cluster = ChaosCluster(root, broker_groups=1, slaves=0, extra_config={"broker": extra, "delay": extra}, env=env)
    mounts = {name: Lazy(root / "backing" / name, root / name, root / f"lazyfs-{name}.out") for name in SERVERS}
    cycles = 1 if settings.quick else 4
    t0 = time.monotonic()
    cut_ms: list[int] = []
    try:
        for m in mounts.values():
            m.up()
        cluster.start()
        cluster.start_load()
        for _ in range(cycles):
            time.sleep(5)
            t_cut = time.monotonic()
            for name in SERVERS:
                cluster.kill(name)
            cut_ms.append(time.time_ns() // 1_000_000)
            for m in mounts.values():
                m.cut()
            for m in mounts.values():
                m.up()
            for name in SERVERS:
                cluster.restart(name)
            result.recovery_s = max(result.recovery_s, time.monotonic() - t_cut)
            result.fault_count += 1
        time.sleep(3)
        result.figures = drain(cluster, settings.log)
        if flush == "periodic":
            _periodic_allowance(cluster, cut_ms, result)
        elif trace.exists():
            report = check_file(trace)
            result.notes.append(f"I/O trace: {report.summary()}")
            if report.violations:
                result.error = f"{len(report.violations)} answers before their fsync: {report.violations[0]}"
    except Exception as exc:
        result.error = f"{type(exc).__name__}: {exc}"
    finally:
        cluster.close()
        for m in mounts.values():
            with contextlib.suppress(Exception):
                m.cut()
    result.duration_s = time.monotonic() - t0
    return result


def _periodic_allowance(cluster: ChaosCluster, cut_ms: list[int], result: Result) -> None:
    """Under periodic flushing what was answered within the interval before a cut may be undone:
    count those as allowed (and say how many), the rest stay lost or duplicated after their ack
    (chaos.checker.periodic_allowance says which is which)."""
    history = History()
    history.read_files(cluster.histories())
    a = periodic_allowance(history, GROUPS, cut_ms, PERIODIC_INTERVAL_MS + FSYNC_MARGIN_MS)
    result.notes.append(
        f"{a.lost_within} (group, message) deliveries lost within flush_interval_ms={PERIODIC_INTERVAL_MS} "
        f"(+{FSYNC_MARGIN_MS} ms for the fsync) before a cut (allowed by the policy, not counted as lost); "
        f"{a.lost_beyond} beyond it; {a.again_within} deliveries again after an ack answered within it, or after "
        f"an ack answered after a cut of a delivery made within it (its pull undone; allowed, not counted as "
        f"duplicated after ack); {a.again_beyond} beyond it; cuts at {cut_ms} (ms since the epoch)"
        + "".join(f"; {e}" for e in a.examples)
    )
    result.figures.lost = a.lost_beyond
    result.figures.duplicated_after_ack = a.again_beyond
