"""`qmq standalone`: one process per role, one ready line, ordered stop, children die with the parent."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from qmq.testing import running_standalone

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def _wait_dead(pid: int, timeout_s: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)  # polling a pid for exit: there is no readiness signal to wait on
    return False


def test_ready_line_and_sigterm_stops_every_role(standalone_dir: Path) -> None:
    with running_standalone(standalone_dir) as proc:
        ready = proc.ready
        assert ready["meta_server"].startswith("http://127.0.0.1:")
        assert ready["meta_server"].endswith("/meta/address")
        meta_pid, broker_pid = proc.pid_of("meta"), proc.pid_of("broker")
        assert _alive(meta_pid)
        assert _alive(broker_pid)
        assert proc.stop() == 0
    assert _wait_dead(meta_pid)
    assert _wait_dead(broker_pid)
    assert (standalone_dir / "broker" / "checkpoint").exists()


def _started_ticks(pid: int) -> int:
    """When the process started, in clock ticks since boot (/proc/PID/stat field 22)."""
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().split(")")[-1].split()[19])


def test_the_gateway_starts_while_the_broker_recovers_not_after_the_delay_server(standalone_dir: Path) -> None:
    with running_standalone(standalone_dir) as proc:
        gateway, delay = proc.pid_of("gateway"), proc.pid_of("delay")
        # the delay server starts once the broker is ready; the gateway when the broker starts
        assert _started_ticks(gateway) <= _started_ticks(delay)
        assert proc.stop() == 0


def test_children_exit_when_the_supervisor_is_killed(standalone_dir: Path) -> None:
    with running_standalone(standalone_dir) as proc:
        meta_pid, broker_pid = proc.pid_of("meta"), proc.pid_of("broker")
        proc.proc.send_signal(signal.SIGKILL)
        proc.proc.wait()
        assert _wait_dead(meta_pid)
        assert _wait_dead(broker_pid)


@pytest.mark.smoke
def test_demo_sends_and_consumes(standalone_dir: Path) -> None:
    with running_standalone(standalone_dir, extra_args=["--demo"]) as proc:
        assert proc.proc.stdout is not None
        lines = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            line = proc.proc.stdout.readline().decode()
            lines.append(line)
            if line.startswith("demo: done") or not line:
                break
        text = "".join(lines)
        assert "demo: sent" in text
        assert "demo: consumed" in text
        assert "demo: done" in text


def test_busy_port_fails_with_a_clear_message(standalone_dir: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        out = subprocess.run(
            [sys.executable, "-m", "qmq", "standalone", "--data-dir", str(standalone_dir), "--broker-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 3
    assert f"port {port}" in out.stderr
    assert "already in use" in out.stderr


def test_bad_config_value_is_named(standalone_dir: Path, tmp_path: Path) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text('[broker]\nflush = "sometimes"\n')
    out = subprocess.run(
        [sys.executable, "-m", "qmq", "standalone", "--data-dir", str(standalone_dir), "--config", str(cfg)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode != 0
    assert "flush = 'sometimes'" in out.stderr
    assert "Traceback" not in out.stderr


def test_log_file_holds_each_role_apart(tmp_path: Path) -> None:
    """`qmq --log-file F standalone` (here $QMQ_LOG_FILE): the supervisor logs to F, each role to
    F-<role> beside it."""
    log = tmp_path / "qmq.log"
    with running_standalone(tmp_path / "data", env={"QMQ_LOG_FILE": str(log), "QMQ_LOG_LEVEL": "INFO"}) as proc:
        assert proc.ready["meta_server"]
    for role in ("meta", "broker", "delay"):
        text = (tmp_path / f"qmq-{role}.log").read_text()
        assert " INFO [" in text, f"the {role} logged nothing to its file"
    assert "standalone" in log.read_text()


def test_a_log_file_that_cannot_be_opened_is_named(tmp_path: Path) -> None:
    bad = tmp_path / "no-such-dir" / "qmq.log"
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "--log-file", str(bad), "meta", "--help"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert f"cannot open {str(bad)!r} for logging" in done.stderr
