"""`qmq standalone` supervises its roles: a role killed with kill -9 is restarted (and serves
again, registered with the meta server under its new pid), at most 3 times a minute; the
fourth crash within the minute makes the supervisor stop the other roles and exit 1."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest

import qmq
from qmq.cli.standalone import Child, Supervisor
from qmq.common.config import StandaloneConfig
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(180)]

# An interpreter start, imports and recovery on a loaded 2-core machine.
RESTART_TIMEOUT_S = 60.0
EXIT_TIMEOUT_S = 60.0
RESTARTS_MAX = 3  # what the README promises: "at most 3 times a minute"


def _children(pid: int) -> dict[int, str]:
    """{pid: command line} of the live child processes of ``pid``."""
    out: dict[int, str] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone meanwhile
        state, ppid = stat.rsplit(")", 1)[1].split()[:2]
        if int(ppid) == pid and state != "Z":
            out[int(entry.name)] = cmdline
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _registered_broker_pid(proc: ReadyProcess) -> int | None:
    """pid of the broker the meta server lists as its broker group's master, if it is available."""
    base = proc.meta_server.removesuffix("/meta/address")
    with urllib.request.urlopen(f"{base}/meta/cluster", timeout=10) as resp:
        view: dict[str, Any] = json.load(resp)
    [group] = [g for g in view["groups"] if g["role"] == "broker"]
    for s in view["servers"]:
        if s["address"] == group["master"] and group["state"] == "available":
            return int(s["pid"])
    return None


def _wait_restarted(proc: ReadyProcess, old_pid: int) -> int:
    """Wait until the supervisor has a new broker child that the meta server lists as master."""
    deadline = time.monotonic() + RESTART_TIMEOUT_S
    while True:
        brokers = [pid for pid, cmd in _children(proc.pid).items() if " broker " in cmd and pid != old_pid]
        try:
            registered = _registered_broker_pid(proc)
        except OSError:
            registered = None
        if brokers and registered in brokers:
            return brokers[0]
        assert proc.proc.poll() is None, f"the supervisor exited with {proc.proc.returncode} instead of restarting"
        assert time.monotonic() < deadline, f"no broker restarted within {RESTART_TIMEOUT_S} s: {brokers}"
        time.sleep(0.1)  # polling the process table and the meta server, bounded by the deadline


def _send_and_consume(meta_server: str) -> None:
    subject = f"restart.{uuid.uuid4().hex[:8]}"
    with qmq.Producer(app_code="t", meta_server=meta_server, send_timeout_ms=30_000) as producer:
        sent = producer.generate_message(subject)
        producer.send(sent)
    with qmq.Consumer(app_code="t", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, "g", start_from="earliest")
        deadline = time.monotonic() + 30
        got: list[str] = []
        while not got:
            assert time.monotonic() < deadline, "the message sent after the restart never came"
            batch = pull.pull(max_messages=10, timeout_ms=1000)
            batch.ack_all()
            got = [m.message_id for m in batch]
    assert got == [sent.message_id]


def test_a_broker_killed_with_kill_9_is_restarted_and_serves(standalone_dir: Path) -> None:
    with running_standalone(standalone_dir) as proc:
        _send_and_consume(proc.meta_server)
        old = proc.pid_of("broker")
        os.kill(old, signal.SIGKILL)
        new = _wait_restarted(proc, old)
        assert new != old
        _send_and_consume(proc.meta_server)
        assert proc.proc.poll() is None
        assert _alive(proc.pid_of("meta"))
        assert _alive(proc.pid_of("delay"))
        assert proc.stop() == 0
    assert not _alive(new)


def test_the_defaults_restart_a_role_at_most_3_times_a_minute() -> None:
    config = StandaloneConfig()
    assert (config.restarts_max, config.restart_window_ms) == (RESTARTS_MAX, 60_000)


def test_the_supervisor_gives_up_after_3_restarts_in_its_window(standalone_dir: Path) -> None:
    # A window of 10 minutes, not the default minute: on a loaded machine (two test workers on two
    # cores) three restarts, each waited for until the meta server lists the new broker, took over
    # a minute, so the fourth crash fell outside the default window and was restarted instead.
    window_ms = 600_000
    with running_standalone(standalone_dir, {"standalone": {"restart_window_ms": window_ms}}) as proc:
        meta_pid, delay_pid = proc.pid_of("meta"), proc.pid_of("delay")
        broker = proc.pid_of("broker")
        started = time.monotonic()
        for _ in range(RESTARTS_MAX):
            os.kill(broker, signal.SIGKILL)
            broker = _wait_restarted(proc, broker)
        os.kill(broker, signal.SIGKILL)  # the fourth crash within the window
        code = proc.proc.wait(EXIT_TIMEOUT_S)
        assert time.monotonic() - started < window_ms / 1000, "the crashes were not within the window"
        assert code == 1
        deadline = time.monotonic() + EXIT_TIMEOUT_S
        while _alive(meta_pid) or _alive(delay_pid):  # the supervisor stopped them before exiting
            assert time.monotonic() < deadline, "the other roles outlived the supervisor"
            time.sleep(0.05)  # polling pids for exit: there is no readiness signal to wait on


# A role's process that comes up only from its Nth start: each start counts itself in a file,
# exits 1 before its ready line until then, and afterwards reports ready and waits to be stopped.
_FLAKY_ROLE = """
import pathlib, sys, time
count = pathlib.Path(sys.argv[1])
n = int(count.read_text() or 0) + 1 if count.exists() else 1
count.write_text(str(n))
if n < int(sys.argv[2]):
    if sys.argv[3:] == ["hang"]:
        time.sleep(600)  # never ready: the supervisor's ready_timeout_ms ends it
    sys.exit(1)
print("qmq ready address=here", flush=True)
time.sleep(600)
"""


def _supervisor_of_flaky_child(
    tmp_path: Path, ready_from_start: int, hang: bool = False, **config: int
) -> tuple[Supervisor, Child, Path]:
    settings = {"restart_window_ms": 600_000, "ready_timeout_ms": 30_000, **config}
    count = tmp_path / "starts"
    argv = [sys.executable, "-c", _FLAKY_ROLE, str(count), str(ready_from_start), *(["hang"] if hang else [])]
    child = Child("broker", argv)
    return Supervisor(StandaloneConfig(data_dir=tmp_path, **settings), None), child, count


@pytest.mark.timeout(60)
def test_a_restart_that_fails_before_ready_counts_as_an_exit_and_is_tried_again(tmp_path: Path) -> None:
    # The broker killed while the supervisor waited for its ready line made the supervisor give
    # up after one restart; such a start is one more exit in the window, not the last.
    supervisor, child, count = _supervisor_of_flaky_child(tmp_path, ready_from_start=3)
    try:
        assert supervisor._restart(child)  # two starts exit before ready, the third comes up
        assert count.read_text() == "3"
        assert len(child.restarts) == 3
        assert child.proc is not None
        assert child.proc.poll() is None
    finally:
        child.stop()


@pytest.mark.timeout(60)
def test_restarts_that_keep_failing_before_ready_give_up_at_the_windows_bound(tmp_path: Path) -> None:
    supervisor, child, count = _supervisor_of_flaky_child(tmp_path, ready_from_start=100)
    assert not supervisor._restart(child)
    assert count.read_text() == str(RESTARTS_MAX)  # three starts, then the fourth exit gives up
    assert len(child.restarts) == RESTARTS_MAX + 1


@pytest.mark.timeout(60)
def test_starts_that_each_outlast_the_window_are_tried_restarts_max_times_in_a_row(tmp_path: Path) -> None:
    # each start hangs until ready_timeout_ms (1.5 s), longer than the window (1 s): the window
    # alone never fills, so the failed starts in a row bound the attempts
    supervisor, child, count = _supervisor_of_flaky_child(
        tmp_path, ready_from_start=100, hang=True, restart_window_ms=1_000, ready_timeout_ms=1_500
    )
    started = time.monotonic()
    assert not supervisor._restart(child)
    assert count.read_text() == str(RESTARTS_MAX)
    assert time.monotonic() - started < 30
    assert child.proc is not None
    assert child.proc.poll() is not None  # the hung start was killed, not left behind


@pytest.mark.timeout(60)
def test_a_stop_asked_for_during_failing_restarts_ends_them(tmp_path: Path) -> None:
    # the supervisor blocks SIGTERM and takes it with sigwaitinfo; one pending (sent to this
    # thread alone, so no other thread of the test process takes it) ends the attempts
    supervisor, child, count = _supervisor_of_flaky_child(tmp_path, ready_from_start=100)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)
        assert supervisor._restart(child)  # back to _supervise, which stops everything
        assert count.read_text() == "1"
        assert signal.SIGTERM in signal.sigpending()
    finally:
        signal.sigtimedwait({signal.SIGTERM}, 0)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
