"""``qmq archive --follow`` as a child process of a test: its JSON progress lines read with a
deadline, stopped by a signal like a person or a supervisor would (Ctrl-C reaches the whole
process group; SIGTERM the command; a crash kills the whole group with SIGKILL)."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from qmq.testing.processes import qmq_argv

_LINE_TIMEOUT_S = 180.0
_STOP_TIMEOUT_S = 120.0
# done() is looked at least this often between lines (it may watch files, not lines)
_CHECK_S = 0.02


class FollowProcess:
    def __init__(
        self, to: Path, source: Sequence[str], extra: Sequence[str] = (), env: Mapping[str, str] | None = None
    ) -> None:
        self.to = to
        self.stderr_path = to.parent / f"{to.name}-follow-{time.time_ns()}.err"
        argv = qmq_argv("archive", "--follow", *source, "--to", str(to), "--json", *extra)
        with open(self.stderr_path, "wb") as err:
            self.proc = subprocess.Popen(
                argv,
                stdout=subprocess.PIPE,
                stderr=err,
                stdin=subprocess.DEVNULL,
                start_new_session=True,  # its own process group, as a command in a terminal
                env=dict(env) if env is not None else None,
            )
        self.lines: list[dict[str, Any]] = []
        self._buf = b""

    def stderr(self) -> str:
        return self.stderr_path.read_text(encoding="utf-8", errors="replace")[-4000:]

    def wait_for(self, done: Callable[[], bool], what: str, timeout_s: float = _LINE_TIMEOUT_S) -> None:
        """Read progress lines until ``done()`` (checked after each line, and every _CHECK_S)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        fd = self.proc.stdout.fileno()
        while not done():  # bounded by the deadline
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {what} within {timeout_s} s; lines {self.lines[-5:]}\n{self.stderr()}")
            readable, _, _ = select.select([fd], [], [], min(left, _CHECK_S))
            if not readable:
                continue
            chunk = os.read(fd, 65536)
            if not chunk:
                code = self.proc.wait()
                if done():
                    return
                raise AssertionError(f"archive --follow exited with {code} before {what}:\n{self.stderr()}")
            self._buf += chunk
            *full, self._buf = self._buf.split(b"\n")
            self.lines.extend(json.loads(line) for line in full if line.strip())

    def interrupt(self) -> int:
        """Ctrl-C: SIGINT to the process group; its exit code."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self._exit()

    def terminate(self) -> int:
        self.proc.send_signal(signal.SIGTERM)
        return self._exit()

    def crash(self) -> None:
        """kill -9 of everything it runs: the driver, Spark's JVM and its Python workers."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(_STOP_TIMEOUT_S)
        self._close()

    def _exit(self) -> int:
        try:
            code = self.proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
            what = f"archive --follow did not stop within {_STOP_TIMEOUT_S} s"
            raise AssertionError(f"{what}:\n{self.stderr()}") from None
        assert self.proc.stdout is not None
        # the progress lines it printed before it stopped
        rest = self._buf + self.proc.stdout.read()
        self._buf = b""
        self.lines.extend(json.loads(line) for line in rest.split(b"\n") if line.strip())
        self._close()
        return code

    def _close(self) -> None:
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def committed_offsets(archive: Path) -> dict[tuple[str, str], int]:
    """The newest manifest's offsets, read without touching the archive (no recovery)."""
    manifests = archive / "_qmq" / "manifests"
    names = sorted(n for n in os.listdir(manifests) if n.endswith(".json")) if manifests.is_dir() else []
    if not names:
        return {}
    doc = json.loads((manifests / names[-1]).read_text(encoding="utf-8"))
    return {(g, s): int(n) for s, groups in doc["offsets"].items() for g, n in groups.items()}
