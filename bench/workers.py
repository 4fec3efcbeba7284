"""The driver's handle on worker processes: spawn with a JSON spec, wait for READY,
send GO, collect the JSON result within a deadline, and kill what overstays.

Every live worker is registered so a signal or an error anywhere can stop them all."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from bench.procfs import stop_pid

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Bound on what we keep of a worker's stdout (its result is one line at the end).
STDOUT_KEEP_BYTES_MAX = 4 << 20

_live: set[WorkerProcess] = set()


def kill_all_workers() -> None:
    for worker in list(_live):
        worker.kill()


class WorkerProcess:
    def __init__(self, spec: dict[str, Any], tag: str, log_dir: str) -> None:
        self.tag = tag
        self.stderr_path = os.path.join(log_dir, f"{tag}.stderr.log")
        self._stderr: IO[bytes] = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in _finish()
        env = dict(os.environ)
        env["PYTHONPATH"] = REPO_ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "bench.worker", json.dumps(spec)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
        )
        self._out = b""
        self._scan_at = 0  # what wait_ready/next_result have consumed of _out
        _live.add(self)

    def _read_some(self, wait_s: float) -> bool:
        """Read what stdout has within wait_s; False at end of file."""
        assert self.proc.stdout is not None
        if self.proc.stdout.closed:
            return False
        fd = self.proc.stdout.fileno()
        readable, _, _ = select.select([fd], [], [], max(0.0, wait_s))
        if not readable:
            return True
        chunk = os.read(fd, 65536)
        if not chunk:
            return False
        self._out += chunk
        if len(self._out) > STDOUT_KEEP_BYTES_MAX:
            dropped = len(self._out) - STDOUT_KEEP_BYTES_MAX
            self._out = self._out[dropped:]
            self._scan_at = max(0, self._scan_at - dropped)
        return True

    def _take_line(self, predicate: Callable[[bytes], bool]) -> bytes | None:
        """The first complete unconsumed line matching predicate; consumes up to it."""
        while True:
            end = self._out.find(b"\n", self._scan_at)
            if end < 0:
                return None
            line = self._out[self._scan_at : end].strip()
            self._scan_at = end + 1
            if predicate(line):
                return line

    def wait_ready(self, limit_s: float) -> bool:
        """Wait for the next READY line (one per round)."""
        deadline = time.monotonic() + limit_s
        while True:
            if self._take_line(lambda line: line == b"READY") is not None:
                return True
            if time.monotonic() >= deadline or not self._read_some(min(0.2, deadline - time.monotonic())):
                return self._take_line(lambda line: line == b"READY") is not None

    def next_result(self, limit_s: float) -> dict[str, Any]:
        """The next JSON result line of a worker serving several rounds."""
        deadline = time.monotonic() + limit_s
        while True:
            line = self._take_line(lambda line: line.startswith(b"{"))
            if line is not None:
                parsed: dict[str, Any] = json.loads(line)
                return parsed
            if time.monotonic() >= deadline:
                self.kill()
                return {"ok": False, "error": f"worker {self.tag} gave no result in {limit_s:.0f} s; killed"}
            if not self._read_some(min(0.5, deadline - time.monotonic())):
                return {"ok": False, "error": f"worker {self.tag} exited without a result; "
                        f"stderr: {self.stderr_tail()}"}

    def go(self) -> None:
        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(b"GO\n")
            self.proc.stdin.flush()
        except BrokenPipeError:
            pass  # it died; result() will say so

    def result(self, limit_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + limit_s
        eof = False
        while time.monotonic() < deadline:
            if not self._read_some(min(0.5, deadline - time.monotonic())):
                eof = True
                break
        if not eof:
            self.kill()
            return {"ok": False, "error": f"worker {self.tag} still running after {limit_s:.0f} s; killed"}
        try:
            self.proc.wait(10.0)
        except subprocess.TimeoutExpired:
            self.kill()
        self._finish()
        for line in reversed(self._out.decode(errors="replace").strip().splitlines()):
            if line.startswith("{"):
                parsed: dict[str, Any] = json.loads(line)
                return parsed
        return {"ok": False, "error": f"worker {self.tag} exited {self.proc.returncode} without a result; "
                f"stderr: {self.stderr_tail()}"}

    def stderr_tail(self, size: int = 600) -> str:
        try:
            with open(self.stderr_path, "rb") as f:
                f.seek(max(0, os.path.getsize(self.stderr_path) - size))
                return f.read().decode(errors="replace").strip()
        except OSError:
            return ""

    def kill(self) -> None:
        if self.proc.poll() is None:
            stop_pid(self.proc.pid, 3.0)
        self._finish()

    def _finish(self) -> None:
        _live.discard(self)
        for stream in (self.proc.stdin, self.proc.stdout):
            if stream is not None and not stream.closed:
                stream.close()
        if not self._stderr.closed:
            self._stderr.close()
