"""`qmq standalone` (meta server + broker [+ delay server] under one supervisor) with
the flush policy under test, ready when it prints its `qmq ready` line."""

from __future__ import annotations

import os
import re
import select
import ssl
import subprocess
import sys
import threading
import time
import urllib.request
from typing import Any

from bench.procfs import pid_alive
from bench.servers.base import ServerProcess, StartError
from bench.settings import HOST, Settings

READY_PREFIX = b"qmq ready"
READY_LIMIT_S = 60.0
# Bound on what we keep from stdout while waiting for the ready line.
READY_SCAN_BYTES_MAX = 1 << 20
_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _probe(code: str) -> str | None:
    """Run code in a fresh interpreter; None if it succeeded, else its last error line."""
    try:
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        return "timed out after 60 s"
    if out.returncode == 0:
        return None
    lines = (out.stderr or out.stdout).strip().splitlines()
    return lines[-1] if lines else f"exit {out.returncode}"


class QmqServer(ServerProcess):
    name = "qmq"
    data_subdirs = ("data",)

    def __init__(self, data_root: str, flush: str, settings: Settings) -> None:
        super().__init__(data_root, settings)
        self.flush = flush
        self.dir = os.path.join(data_root, f"qmq-{flush}")
        self.named_pids: list[int] = []
        self.delay_pid: int | None = None
        self.ready_line = ""
        self.delay_http = ""
        self._copier: threading.Thread | None = None
        # TLS and an auth file (bench/secure_throughput.py): more options for `qmq standalone`,
        # its environment, and what the workers connect with (ca_file, secret) in the endpoint
        self.extra_args: list[str] = []
        self.extra_env: dict[str, str] = {}
        self.endpoint_extra: dict[str, Any] = {}
        self._ca_file: str | None = None

    def missing(self) -> str | None:
        err = _probe("from qmq.aio import Producer, Consumer")
        if err is not None:
            return f"qmq SDK not available yet (from qmq.aio import Producer, Consumer: {err})"
        return None

    def durability(self) -> str:
        if self.flush == "sync":
            return "flush = sync: a send is acknowledged after its batch is fsynced (group commit)"
        return (
            f"flush = periodic: acknowledged once written; fsync every "
            f"{self.settings.qmq_flush_interval_ms} ms"
        )

    def version(self) -> str | None:
        try:
            commit = subprocess.run(
                ["git", "-C", _REPO_ROOT, "describe", "--always", "--dirty"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.TimeoutExpired):
            commit = ""
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = version("qmq")
        except PackageNotFoundError:
            release = "?"
        return f"{release} ({commit})" if commit else release

    def _write_config(self) -> str:
        path = os.path.join(self.dir, "qmq.toml")
        with open(path, "w") as f:
            f.write(f'[broker]\nflush = "{self.flush}"\n')
            if self.flush == "periodic":
                f.write(f"flush_interval_ms = {self.settings.qmq_flush_interval_ms}\n")
            # the delay server (W4, W5) acknowledges under the same policy as the broker
            f.write(f'[delay]\nflush = "{self.flush}"\n')
            if self.flush == "periodic":
                f.write(f"flush_interval_ms = {self.settings.qmq_flush_interval_ms}\n")
        return path

    def start(self) -> dict[str, Any]:
        self.fresh_dir()
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=self.keep_data)
        config = self._write_config()
        self.popen(
            [
                sys.executable, "-m", "qmq", "standalone",
                "--data-dir", data,
                "--host", HOST,
                "--meta-port", "0",
                "--broker-port", "0",
                "--config", config,
                *self.extra_args,
            ],
            env={**os.environ, **self.extra_env} if self.extra_env else None,
            stdout_pipe=True,
        )
        line = self._wait_ready_line()
        self.ready_line = line
        meta = re.search(r"meta_server=(\S+)", line)
        if meta is None:
            raise StartError(f"qmq ready line has no meta_server=URL: {line!r}")
        self.named_pids = [int(pid) for pid in re.findall(r"\b(?:broker|meta|delay)_pid=(\d+)", line)]
        delay_pid = re.search(r"\bdelay_pid=(\d+)", line)
        self.delay_pid = int(delay_pid.group(1)) if delay_pid else None
        delay_http = re.search(r"delay_http=(https?://\S+)", line)
        self.delay_http = delay_http.group(1) if delay_http else ""
        broker_http = re.search(r"broker_http=(https?://\S+)", line)
        self.broker_http = broker_http.group(1) if broker_http else ""
        assert self.proc is not None
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        self._copier = threading.Thread(target=self._copy_stdout, args=(stdout,), daemon=True)
        self._copier.start()
        self._ca_file = self.endpoint_extra.get("ca_file")
        endpoint: dict[str, Any] = {"meta_server": meta.group(1), **self.endpoint_extra}
        gateway = re.search(r"\bgateway=(https?://\S+)", line)
        gateway_pid = re.search(r"\bgateway_pid=(\d+)", line)
        if gateway and gateway_pid:
            endpoint.update(gateway=gateway.group(1), gateway_pid=int(gateway_pid.group(1)))
        return endpoint

    def role_pids(self) -> dict[str, list[int]]:
        """broker, meta, delay, gateway (from the ready line) and the supervisor."""
        found = re.findall(r"\b(broker|meta|delay|gateway)_pid=(\d+)", self.ready_line)
        roles = {role: [int(pid)] for role, pid in found}
        named = {pid for pids in roles.values() for pid in pids}
        rest = [pid for pid in super().pids() if pid not in named]
        return {**roles, "supervisor": rest} if rest else roles

    def delay_holder_pids(self) -> list[int]:
        """The delay server's process: it alone holds pending delayed messages (the broker
        only stores what comes due, as for any send)."""
        if self.delay_pid is not None and pid_alive(self.delay_pid):
            return [self.delay_pid]
        return self.pids()

    def delay_lateness_counts(self) -> dict[str, int] | None:
        """The delay server's ``qmq_delay_fire_lateness_ms`` histogram (hand-over − due)."""
        return _histogram(self.delay_http, "qmq_delay_fire_lateness_ms", self._ca_file)

    def fsync_seconds_counts(self) -> dict[str, int] | None:
        """The broker's ``qmq_store_flush_seconds`` histogram (one fdatasync of its logs)."""
        return _histogram(self.broker_http, "qmq_store_flush_seconds", self._ca_file)

    def _wait_ready_line(self) -> str:
        assert self.proc is not None
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        seen = b""
        deadline = time.monotonic() + READY_LIMIT_S
        while time.monotonic() < deadline and len(seen) < READY_SCAN_BYTES_MAX:
            readable, _, _ = select.select([fd], [], [], 0.2)
            if readable:
                chunk = os.read(fd, 65536)
                if not chunk:
                    break
                seen += chunk
                for raw in seen.splitlines():
                    if raw.startswith(READY_PREFIX):
                        self._log_bytes(seen)
                        return raw.decode(errors="replace")
            elif self.proc.poll() is not None:
                break
        self._log_bytes(seen)
        if self.proc.poll() is not None:
            raise StartError(
                f"qmq standalone exited with {self.proc.returncode} before `qmq ready`; see {self.log_path}"
            )
        raise StartError(f"qmq standalone printed no `qmq ready` line in {READY_LIMIT_S:.0f} s; see {self.log_path}")

    def _log_bytes(self, data: bytes) -> None:
        if self._log is not None and data:
            self._log.write(data)
            self._log.flush()

    def _copy_stdout(self, stdout: Any) -> None:
        # Keep draining: a full pipe would block the server's prints mid-benchmark.
        try:
            for chunk in iter(lambda: stdout.read1(65536), b""):
                self._log_bytes(chunk)
        except (OSError, ValueError):
            return

    def pids(self) -> list[int]:
        tree = super().pids()
        return tree + [pid for pid in self.named_pids if pid not in tree and pid_alive(pid)]

    def stop(self) -> None:
        super().stop()
        self.named_pids = []


def _histogram(http: str, name: str, ca_file: str | None = None) -> dict[str, int] | None:
    """A cumulative histogram from a role's /metrics: bucket bound → count (over TLS, trusting ca_file)."""
    if not http:
        return None
    context = ssl.create_default_context(cafile=ca_file) if http.startswith("https://") else None
    with urllib.request.urlopen(f"{http}/metrics", timeout=5, context=context) as response:
        text = response.read().decode()
    found = re.findall(rf'^{name}_bucket\{{le="([^"]+)"\}} (\S+)$', text, re.MULTILINE)
    return {bound: int(float(count)) for bound, count in found}
