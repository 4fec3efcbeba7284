"""Child processes of qmq roles, started and stopped for tests and benchmarks."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_READY_TIMEOUT_S = 60.0
_STOP_TIMEOUT_S = 30.0


@dataclass
class ReadyProcess:
    """A running qmq process and the ``key=value`` pairs of its ``qmq ready`` line."""

    proc: subprocess.Popen[bytes]
    ready: dict[str, str] = field(default_factory=dict)
    exit_code: int | None = None

    @property
    def meta_server(self) -> str:
        return self.ready["meta_server"]

    @property
    def gateway(self) -> str:
        """``http://HOST:PORT`` of the HTTP gateway (``qmq gateway``, or the one of ``qmq standalone``)."""
        return self.ready["gateway"]

    @property
    def pid(self) -> int:
        return self.proc.pid

    def pid_of(self, role: str) -> int:
        """pid of a child role of standalone (``meta`` or ``broker``)."""
        return int(self.ready[f"{role}_pid"])

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = _STOP_TIMEOUT_S) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            self.exit_code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.exit_code = self.proc.wait()
            raise AssertionError(
                f"process {self.proc.args!r} did not stop within {timeout_s} s of signal {sig}"
            ) from None
        finally:
            if self.proc.stdout is not None:
                self.proc.stdout.close()
        return self.exit_code


def write_config(path: Path, sections: Mapping[str, Mapping[str, Any]]) -> Path:
    """Write a TOML config file of ``{section: {key: value}}`` (strings, numbers, booleans)."""
    lines: list[str] = []
    for section, values in sections.items():
        lines.append(f"[{section}]")
        for key, value in values.items():
            if isinstance(value, bool):
                text = "true" if value else "false"
            elif isinstance(value, int | float):
                text = repr(value)
            else:
                text = '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'
            lines.append(f"{key} = {text}")
        lines.append("")
    path.write_text("\n".join(lines), encoding="utf-8")
    return path


def start_ready(
    argv: Sequence[str], timeout_s: float = _READY_TIMEOUT_S, env: Mapping[str, str] | None = None
) -> ReadyProcess:
    """Start ``argv`` and return once it printed a line starting with ``qmq ready``."""
    full_env = dict(os.environ)
    full_env.setdefault("QMQ_LOG_LEVEL", "WARNING")
    if env:
        full_env.update(env)
    proc = subprocess.Popen(list(argv), stdout=subprocess.PIPE, stdin=subprocess.DEVNULL, env=full_env)
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    deadline = time.monotonic() + timeout_s
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise AssertionError(f"{list(argv)} printed no 'qmq ready' line within {timeout_s} s")
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            code = proc.wait()
            proc.stdout.close()
            raise AssertionError(f"{list(argv)} exited with status {code} before it was ready")
        buf += chunk
        if b"\n" in buf:
            for line in buf.split(b"\n")[:-1]:
                text = line.decode("utf-8", "replace")
                if text.startswith("qmq ready"):
                    pairs = dict(p.split("=", 1) for p in text.split()[2:] if "=" in p)
                    return ReadyProcess(proc, pairs)
            buf = buf.rsplit(b"\n", 1)[1]


def qmq_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "qmq", *args]


@contextmanager
def running_standalone(
    data_dir: Path,
    config: Mapping[str, Mapping[str, Any]] | None = None,
    extra_args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
) -> Iterator[ReadyProcess]:
    """``qmq standalone`` on 127.0.0.1, ports 0, data in ``data_dir``; stopped with SIGTERM on exit."""
    args = ["standalone", "--data-dir", str(data_dir), "--host", "127.0.0.1", "--meta-port", "0", "--broker-port", "0"]
    if config:
        data_dir.mkdir(parents=True, exist_ok=True)
        args += ["--config", str(write_config(data_dir.parent / f"{data_dir.name}.toml", config))]
    proc = start_ready(qmq_argv(*args, *extra_args), env=env)
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.stop()
        elif proc.proc.stdout is not None:
            proc.proc.stdout.close()


@contextmanager
def running_role(args: Sequence[str], env: Mapping[str, str] | None = None) -> Iterator[ReadyProcess]:
    """One role, e.g. ``running_role(["broker", "--data-dir", d, "--meta-server", url])``."""
    proc = start_ready(qmq_argv(*args), env=env)
    try:
        yield proc
    finally:
        if proc.proc.poll() is None:
            proc.stop()
        elif proc.proc.stdout is not None:
            proc.proc.stdout.close()


@contextmanager
def running_gateway(meta_server: str, env: Mapping[str, str] | None = None, *args: str) -> Iterator[ReadyProcess]:
    """``qmq gateway`` on 127.0.0.1, port 0, for the meta server at ``meta_server``; its URL is
    ``.gateway`` once it printed its ready line. ``args`` are more options (``--ack-timeout-ms``)."""
    with running_role(
        ["gateway", "--meta-server", meta_server, "--host", "127.0.0.1", "--port", "0", *args], env=env
    ) as proc:
        yield proc
