"""Server-side cost of one workload: CPU seconds (utime + stime of every server process,
before and after) and peak resident memory (sampled on a thread)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

from bench.procfs import cpu_seconds, rss_kib

RSS_SAMPLE_INTERVAL_S = 0.1


def total_rss_kib(pids: list[int]) -> int:
    return sum(rss_kib(pid) or 0 for pid in pids)


class ServerMonitor:
    """Measures the server processes named by `pids_now` (re-read at every sample, so
    a child a supervisor starts mid-run is counted too) between start() and stop()."""

    def __init__(self, pids_now: Callable[[], list[int]]) -> None:
        self._pids_now = pids_now
        self._cpu_start: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._rss_peak_kib = 0
        self._rss_start_kib = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started_at = 0.0

    def start(self) -> None:
        pids = self._pids_now()
        self._cpu_start = {pid: cpu_seconds(pid) or 0.0 for pid in pids}
        self._cpu_last = dict(self._cpu_start)
        self._rss_start_kib = total_rss_kib(pids)
        self._rss_peak_kib = self._rss_start_kib
        self._started_at = time.monotonic()
        self._thread = threading.Thread(target=self._sample_loop, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss_now_kib(self) -> int:
        return total_rss_kib(self._pids_now())

    def _sample(self) -> None:
        pids = self._pids_now()
        rss = 0
        for pid in pids:
            rss += rss_kib(pid) or 0
            cpu = cpu_seconds(pid)
            if cpu is not None:
                # A process first seen mid-run counts from zero: it was started by the workload.
                self._cpu_start.setdefault(pid, 0.0)
                self._cpu_last[pid] = cpu
        self._rss_peak_kib = max(self._rss_peak_kib, rss)

    def _sample_loop(self) -> None:
        while not self._stop.wait(RSS_SAMPLE_INTERVAL_S):
            self._sample()

    def stop(self, messages: int) -> dict[str, Any]:
        """Stop sampling; the figures, with CPU normalised per 100k messages."""
        self._sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join(2.0)
        cpu_s = sum(self._cpu_last[pid] - self._cpu_start.get(pid, 0.0) for pid in self._cpu_last)
        wall_s = time.monotonic() - self._started_at
        return {
            "server_cpu_s": round(cpu_s, 3),
            "server_cpu_s_per_100k": round(cpu_s * 100_000 / messages, 3) if messages else None,
            "server_cpu_utilisation": round(cpu_s / wall_s, 3) if wall_s > 0 else None,
            "server_rss_start_mib": round(self._rss_start_kib / 1024, 1),
            "server_rss_peak_mib": round(self._rss_peak_kib / 1024, 1),
        }
