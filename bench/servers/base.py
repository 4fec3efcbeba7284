"""What every server the harness runs has in common: a fresh data dir, a log file, a
readiness wait bounded in time, the PIDs to measure, and a stop by PID."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from typing import IO, Any

from bench.procfs import non_loopback_listeners, port_open, process_tree, stop_pid
from bench.settings import Settings

STOP_GRACE_S = 30.0


class StartError(RuntimeError):
    """The server did not come up; the message says why and where its log is."""


class ServerProcess:
    """One server (possibly a tree of processes) under a private data directory."""

    name = "?"
    package: str | None = None  # Debian package, for the version record
    data_subdirs: tuple[str, ...] = ()  # removed after the run; logs beside them stay

    def __init__(self, data_root: str, settings: Settings) -> None:
        self.settings = settings
        self.dir = os.path.join(data_root, self.name)
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        # set while restart_keeping_data() starts the server again on the data it holds (W10)
        self.keep_data = False

    # -- overridden per server -------------------------------------------------
    def missing(self) -> str | None:
        """Why this server cannot run here, or None."""
        return None

    def start(self) -> dict[str, Any]:
        """Start the server and return the endpoint the workers connect to."""
        raise NotImplementedError

    def durability(self) -> str:
        raise NotImplementedError

    def version(self) -> str | None:
        return None

    def delay_unsupported(self) -> str | None:
        """Why this server has no delayed delivery to measure (W4/W5), or None to try."""
        return None

    def delay_lateness_counts(self) -> dict[str, int] | None:
        """The server's own count of delayed messages by how late it handed them on (a
        cumulative histogram, bucket bound in ms → count), or None where it keeps none."""
        return None

    def fsync_seconds_counts(self) -> dict[str, int] | None:
        """The server's own count of fsyncs by how long they took (cumulative histogram,
        bound in seconds → count), or None where it keeps none."""
        return None

    def delay_holder_pids(self) -> list[int]:
        """The processes that hold pending delayed messages (W4's RSS per pending): the whole
        server unless a system keeps them in a process of their own."""
        return self.pids()

    def extra_pids(self) -> list[int]:
        """Processes outside the main tree that serve the system (RabbitMQ's epmd)."""
        return []

    def role_pids(self) -> dict[str, list[int]]:
        """The server's processes by role, for memory per role (W10): one role unless a system has more."""
        return {"server": self.pids()}

    # -- shared ------------------------------------------------------------------
    def restart_keeping_data(self) -> dict[str, Any]:
        """Start again on the same data, once stopped (W10's restart time); the new endpoint."""
        self.keep_data = True
        try:
            return self.start()
        finally:
            self.keep_data = False

    def fresh_dir(self) -> None:
        if self.keep_data:
            os.makedirs(self.dir, exist_ok=True)
            return
        if os.path.isdir(self.dir):
            shutil.rmtree(self.dir)
        os.makedirs(self.dir)

    @property
    def log_path(self) -> str:
        return os.path.join(self.dir, "server.log")

    def popen(self, argv: list[str], env: dict[str, str] | None = None, stdout_pipe: bool = False) -> None:
        self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            argv,
            stdout=subprocess.PIPE if stdout_pipe else self._log,
            stderr=self._log,
            stdin=subprocess.DEVNULL,
            env=env,
            cwd=self.dir,
            start_new_session=True,  # Ctrl-C in the terminal reaches the driver only; it stops us.
        )

    def ensure_port_free(self, port: int) -> None:
        """Refuse to start on a port someone else listens on: we would measure their server."""
        if port_open(port):
            raise StartError(f"{self.name}: port {port} is already in use on loopback; stop what holds it")

    def wait_port(self, port: int, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise StartError(f"{self.name} exited with {self.proc.returncode} while starting; see {self.log_path}")
            if port_open(port):
                return
            time.sleep(0.1)
        raise StartError(f"{self.name}: port {port} not open after {limit_s:.0f} s; see {self.log_path}")

    def pids(self) -> list[int]:
        """Every process whose CPU and memory count as the server's."""
        tree = process_tree(self.proc.pid) if self.proc is not None else []
        return tree + [pid for pid in self.extra_pids() if pid not in tree]

    def check_loopback_only(self) -> None:
        exposed = non_loopback_listeners(self.pids())
        if exposed:
            raise StartError(f"{self.name} listens beyond loopback on {exposed}; refusing to run")

    def stop(self) -> None:
        if self.proc is not None:
            # The whole tree, leaves last: a supervisor normally stops its children itself.
            tree = process_tree(self.proc.pid)
            stop_pid(self.proc.pid, STOP_GRACE_S)
            for pid in tree[1:]:
                stop_pid(pid, 5.0)
            self.proc = None
        if self._log is not None:
            self._log.close()
            self._log = None

    def remove_data(self) -> None:
        """Delete the data dir but keep the logs (for post-mortems of a failed cell)."""
        for sub in self.data_subdirs:
            shutil.rmtree(os.path.join(self.dir, sub), ignore_errors=True)


def dpkg_version(package: str) -> str | None:
    try:
        out = subprocess.run(
            ["dpkg-query", "-W", "-f=${Version}", package], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None
