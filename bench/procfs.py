"""Reading /proc: CPU time, resident memory and the process tree of a server, and
stopping one process by its PID (never by name: other engineers share this machine)."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import time

_CLOCK_TICKS_PER_S = os.sysconf("SC_CLK_TCK")
# A bound on tree walks, so a fork bomb under a server cannot stall the sampler.
_TREE_PIDS_MAX = 256


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of one process, in seconds; None once the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            stat = f.read()
    except OSError:
        return None
    # The command name may contain spaces and parentheses; fields start after the last ')'.
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _CLOCK_TICKS_PER_S


def rss_kib(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def children(pid: int) -> list[int]:
    found: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                found.extend(int(x) for x in f.read().split())
        except OSError:
            continue
    return found


def process_tree(root_pid: int) -> list[int]:
    """The root and all its live descendants, breadth first, at most _TREE_PIDS_MAX."""
    tree: list[int] = []
    frontier = [root_pid]
    while frontier and len(tree) < _TREE_PIDS_MAX:
        pid = frontier.pop(0)
        if pid_alive(pid):
            tree.append(pid)
            frontier.extend(children(pid))
    return tree


def command_name(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return None


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _reap(pid: int) -> bool:
    """True once pid has exited (reaping it if it is our child)."""
    try:
        done, _status = os.waitpid(pid, os.WNOHANG)
        return done == pid
    except ChildProcessError:
        return not pid_alive(pid)


def stop_pid(pid: int, grace_s: float) -> str:
    """SIGTERM, wait up to grace_s, then SIGKILL. Returns how it ended."""
    if not pid_alive(pid):
        return "not running"
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        if _reap(pid):
            return "terminated"
        time.sleep(0.05)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    kill_deadline = time.monotonic() + 5.0
    while time.monotonic() < kill_deadline:
        if _reap(pid):
            break
        time.sleep(0.05)
    return f"killed after {grace_s:.0f} s"


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    with socket.socket() as s:
        s.settimeout(0.3)
        try:
            s.connect((host, port))
        except OSError:
            return False
        return True


def non_loopback_listeners(pids: list[int]) -> list[str]:
    """TCP listeners owned by pids that are not bound to loopback (should be none)."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:["):
                inodes.add(target[8:-1])
    exposed: list[str] = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if cols[3] != "0A" or cols[9] not in inodes:  # 0A: LISTEN
                continue
            address, port_hex = cols[1].split(":")
            if not address.endswith("0100007F") and address != "00000000000000000000000001000000":
                exposed.append(f"{address}:{int(port_hex, 16)}")
    return exposed
