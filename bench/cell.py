"""What a workload needs from the driver: the system under test, its endpoint and server
processes, and helpers that spawn worker processes and measure the server around them."""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from typing import Any

from bench.monitor import ServerMonitor
from bench.servers import ServerProcess
from bench.settings import Settings
from bench.workers import REPO_ROOT, WorkerProcess

READY_LIMIT_S = 60.0
SETUP_LIMIT_S = 120.0
_families = itertools.count(1)


class CellError(RuntimeError):
    """A step of a workload failed; the cell reports the message."""


@dataclasses.dataclass
class Cell:
    system: str
    server: ServerProcess
    endpoint: dict[str, Any]
    settings: Settings
    log_dir: str
    log: Callable[[str], None]

    def family(self, workload: str) -> str:
        """A fresh name for the destinations of one measured cell ([a-z0-9] only)."""
        return f"{workload.lower()}n{next(_families)}"

    def spec(self, role: str, family: str, subjects: list[str], limit_s: float, **extra: Any) -> dict[str, Any]:
        return {
            "system": self.system,
            "endpoint": self.endpoint,
            "settings": self.settings.to_json(),
            "role": role,
            "family": family,
            "subjects": subjects,
            "limit_s": limit_s,
            **extra,
        }

    def spawn(self, tag: str, spec: dict[str, Any]) -> WorkerProcess:
        return WorkerProcess(spec, f"{self.system}-{tag}", self.log_dir)

    def setup(self, family: str, subjects: list[str], **extra: Any) -> dict[str, Any]:
        """Run the setup role; its result (may say `skipped`). Raises CellError on failure."""
        worker = self.spawn(f"{family}-setup", self.spec("setup", family, subjects, SETUP_LIMIT_S, **extra))
        result = worker.result(SETUP_LIMIT_S + 30.0)
        if not result.get("ok"):
            raise CellError(f"setup failed: {result.get('error')}")
        return result

    def ready(self, worker: WorkerProcess) -> None:
        if not worker.wait_ready(READY_LIMIT_S):
            worker.kill()
            raise CellError(f"worker {worker.tag} not ready in {READY_LIMIT_S:.0f} s: {worker.stderr_tail()}")

    def monitor(self) -> ServerMonitor:
        return ServerMonitor(self.server.pids)

    def run_one(
        self, tag: str, spec: dict[str, Any], limit_s: float, count: int
    ) -> tuple[dict[str, Any], dict[str, Any]]:
        """One worker: spawned, ready, then released with the servers watched until its result.
        Its result (CellError unless ok) and the servers' CPU and RSS per ``count`` messages."""
        worker = self.spawn(tag, spec)
        self.ready(worker)
        monitor = self.monitor()
        monitor.start()
        worker.go()
        result = require_ok(worker.result(limit_s + 10.0), spec["role"])
        return result, monitor.stop(count)

    def run_bench(self, module: str, args: list[str], limit_s: float, what: str,
                  count: int | None = None) -> tuple[dict[str, Any], dict[str, Any] | None]:
        """A bench of its own (``python -m module args``, this tree first on PYTHONPATH) run as a
        cell: the JSON document of its last line of output and, ``count`` given, the servers
        watched around it (CPU per ``count`` messages, peak RSS)."""
        argv = [sys.executable, "-m", module, *args]
        path = (REPO_ROOT + os.pathsep + os.environ.get("PYTHONPATH", "")).rstrip(os.pathsep)
        monitor = self.monitor() if count is not None else None
        if monitor is not None:
            monitor.start()
        try:
            done = subprocess.run(argv, capture_output=True, timeout=limit_s, env={**os.environ, "PYTHONPATH": path},
                                  check=False, cwd=REPO_ROOT)
        except subprocess.TimeoutExpired:
            raise CellError(f"{what} did not finish within {limit_s:.0f} s") from None
        finally:
            server = monitor.stop(count or 0) if monitor is not None else None
        if done.returncode != 0:
            tail = done.stderr.decode(errors="replace").strip().splitlines()[-3:]
            raise CellError(f"{what} exited {done.returncode}: {' | '.join(tail)}")
        lines = done.stdout.decode(errors="replace").strip().splitlines()
        try:
            result: dict[str, Any] = json.loads(lines[-1])
        except (IndexError, json.JSONDecodeError):
            raise CellError(f"{what} printed no JSON line: {lines[-1:] or 'nothing'}") from None
        return result, server

    def worker_limit_s(self, expected_s: float) -> float:
        return expected_s + self.settings.worker_slack_s


def require_ok(result: dict[str, Any], what: str) -> dict[str, Any]:
    if not result.get("ok"):
        raise CellError(f"{what}: {result.get('error') or 'failed'}")
    return result


def timed(fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one cell; a failure becomes the cell's figure instead of stopping the run."""
    started = time.monotonic()
    try:
        result = fn()
        result.setdefault("ok", True)
    except CellError as exc:
        result = {"ok": False, "error": str(exc)}
    except Exception as exc:
        result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    result["wall_s"] = round(time.monotonic() - started, 1)
    return result
