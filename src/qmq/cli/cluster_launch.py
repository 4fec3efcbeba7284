"""Starting and stopping the processes of a local cluster (``qmq cluster up`` / ``down``).

Each role is its own ``qmq meta|broker|delay`` process with its group, role and data directory
on its command line (so ``ps`` shows what it is), started in a session of its own so that it
outlives the command. It logs to ``DATA_DIR/logs/<name>.log`` (``--log-file``: rotated, so
bounded on disk); its stdout and stderr (the ready line, and anything printed before
logging starts) go to ``DATA_DIR/logs/<name>.out``. A process is ready when that file shows
its ``qmq ready`` line.

``DATA_DIR/cluster.json`` lists every process started (written before waiting for each, so
``down`` finds even a half-started cluster) with its pid and its start time in clock ticks
since boot: a pid reused by another program after a crash is never signalled.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Final

from qmq.common.errors import QmqError

CLUSTER_FILE: Final = "cluster.json"
LOG_DIR: Final = "logs"
# How often a log is looked at for the ready line, and a pid for its exit.
_POLL_S: Final = 0.05
# A ready line comes within the first lines of a log; a longer line is not one.
_LINE_BYTES_MAX: Final = 64 * 1024
# After SIGKILL the kernel frees a process at once; this only covers a loaded machine.
_KILL_WAIT_S: Final = 5.0
# The log lines quoted when a process exits before it is ready.
_TAIL_LINES: Final = 3


class ClusterError(QmqError):
    """A cluster cannot be started, found or stopped; the message says which process and why."""


class StartupFailedError(ClusterError):
    """A process of the cluster exited or stayed silent before its ready line."""


@dataclass
class Member:
    """One process of the cluster: what it is, how it was started, where it logs."""

    name: str
    role: str
    group: str | None
    role_in_group: str | None
    data_dir: str
    argv: list[str]
    log: str  # what it logs (rotated); its stdout and stderr go to ``out_path(log)``
    pid: int = 0
    start_ticks: int = 0
    ready: dict[str, str] = field(default_factory=dict)


@dataclass
class Cluster:
    """What ``DATA_DIR/cluster.json`` holds."""

    data_dir: str
    meta_server: str
    members: list[Member]
    started_at_ms: int

    def path(self) -> Path:
        return Path(self.data_dir) / CLUSTER_FILE

    def save(self) -> None:
        """Write cluster.json whole or not at all (temp file, fsync, rename)."""
        path = self.path()
        tmp = path.with_suffix(".json.tmp")
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(asdict(self), fh, indent=2)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)

    @staticmethod
    def load(data_dir: Path) -> Cluster:
        path = data_dir / CLUSTER_FILE
        try:
            doc = json.loads(path.read_text(encoding="utf-8"))
            return Cluster(
                data_dir=doc["data_dir"],
                meta_server=doc["meta_server"],
                members=[Member(**m) for m in doc["members"]],
                started_at_ms=doc["started_at_ms"],
            )
        except FileNotFoundError:
            raise ClusterError(
                f"no {CLUSTER_FILE} in {str(data_dir)!r}: no cluster was started there with "
                "`qmq cluster up --data-dir DIR` (or it was stopped)"
            ) from None
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ClusterError(f"{str(path)!r} cannot be read as a cluster file ({exc}); was it edited?") from None


def plan(
    data_dir: Path,
    *,
    broker_groups: int,
    slaves: int,
    delay_groups: int,
    host: str,
    meta_port: int,
    config_file: Path | None,
    gateways: int = 0,
    secure: Sequence[str] = (),
    app_code: str = "",
) -> list[Member]:
    """The processes of a cluster, in start order: meta, broker masters, delay masters, broker
    slaves, delay slaves (``slaves`` per group of either role), gateways.

    Every process but the meta server gets ``--meta-server URL`` added once the meta server is ready.
    ``secure`` (--auth-file, --tls-*, --insecure) goes to every process, ``app_code`` (the servers'
    own app) to every one but the meta server.
    """
    qmq = [sys.executable, "-m", "qmq"]
    common = ["--host", host] + (["--config", str(config_file.resolve())] if config_file else [])

    def member(name: str, role: str, group: str | None, role_in_group: str | None, args: list[str]) -> Member:
        d = data_dir / name
        # a gateway keeps no data: its directory holds nothing, it is named for `cluster status`
        data = [] if role == "gateway" else ["--data-dir", str(d)]
        own = ["--app-code", app_code] if app_code and role != "meta" else []
        return Member(
            name=name,
            role=role,
            group=group,
            role_in_group=role_in_group,
            data_dir=str(d),
            argv=[*qmq, role, *args, *data, *common, *secure, *own],
            log=str(data_dir / LOG_DIR / f"{name}.log"),
        )

    members = [member("meta", "meta", None, None, ["--port", str(meta_port)])]
    for i in range(1, broker_groups + 1):
        members.append(member(f"b{i}-m", "broker", f"b{i}", "master", ["--group", f"b{i}", "--role", "master"]))
    for i in range(1, delay_groups + 1):
        members.append(member(f"d{i}", "delay", f"d{i}", "master", ["--group", f"d{i}", "--role", "master"]))
    for i in range(1, broker_groups + 1):
        for j in range(1, slaves + 1):
            members.append(member(f"b{i}-s{j}", "broker", f"b{i}", "slave", ["--group", f"b{i}", "--role", "slave"]))
    for i in range(1, delay_groups + 1):
        for j in range(1, slaves + 1):
            members.append(member(f"d{i}-s{j}", "delay", f"d{i}", "slave", ["--group", f"d{i}", "--role", "slave"]))
    # the gateways sign receipts with one key, so any of them settles what another handed out
    key = ["--receipt-key-file", str(receipt_key_path(data_dir))]
    for i in range(1, gateways + 1):
        members.append(member(f"g{i}", "gateway", None, None, ["--port", "0", *key]))
    return members


def receipt_key_path(data_dir: Path) -> Path:
    return data_dir / "gateway-receipt.key"


def ensure_receipt_key(data_dir: Path) -> None:
    """The cluster's gateway receipt key (docs/gateway.md): made once, readable by its owner only,
    and kept, so receipts stay valid across restarts of the gateways."""
    path = receipt_key_path(data_dir)
    if path.exists():
        return
    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as out:
        out.write(secrets.token_hex(32) + "\n")


def out_path(log: str) -> str:
    """Where a member's stdout and stderr go, beside its log."""
    return str(Path(log).with_suffix(".out"))


def start(member: Member, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
    """Start ``member`` detached (its own session), logging to its log file."""
    Path(member.data_dir).parent.mkdir(parents=True, exist_ok=True)
    Path(member.log).parent.mkdir(parents=True, exist_ok=True)
    with open(out_path(member.log), "ab") as out:
        proc = subprocess.Popen(
            member.argv,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=out,
            env={**env, "QMQ_LOG_FILE": member.log},
            start_new_session=True,
        )
    member.pid = proc.pid
    member.start_ticks = start_ticks(proc.pid) or 0
    return proc


class _LogWatch:
    """Reads a member's stdout as it grows, looking for the ``qmq ready`` line."""

    def __init__(self, member: Member) -> None:
        self.member = member
        self.path = out_path(member.log)
        try:
            self.offset = os.path.getsize(self.path)  # a restarted cluster appends to old output
        except OSError:
            self.offset = 0
        self.partial = b""

    def ready_line(self) -> dict[str, str] | None:
        with open(self.path, "rb") as fh:
            fh.seek(self.offset)
            chunk = fh.read()
        self.offset += len(chunk)
        lines = (self.partial + chunk).split(b"\n")
        self.partial = lines.pop()[-_LINE_BYTES_MAX:]
        for line in lines:
            text = line.decode("utf-8", "replace")
            if text.startswith("qmq ready"):
                return dict(part.split("=", 1) for part in text.split()[2:] if "=" in part)
        return None


def wait_ready(procs: Mapping[str, subprocess.Popen[bytes]], members: Sequence[Member], deadline: float) -> None:
    """Return once every member printed its ready line; StartupFailedError naming the first that cannot."""
    watches = [_LogWatch(m) for m in members]
    waiting = list(watches)
    while waiting:
        for w in list(waiting):
            ready = w.ready_line()
            if ready is not None:
                w.member.ready = ready
                waiting.remove(w)
                continue
            code = procs[w.member.name].poll()
            if code is not None:
                raise StartupFailedError(
                    f"{w.member.name} ({' '.join(w.member.argv[2:4])}) exited with status {code} before it was "
                    f"ready; its log {w.member.log} ends: {log_tail(Path(w.member.log))}; its output "
                    f"{w.path} ends: {log_tail(Path(w.path))}"
                )
        if not waiting:
            return
        if time.monotonic() >= deadline:
            names = ", ".join(w.member.name for w in waiting)
            raise StartupFailedError(
                f"{names} printed no ready line in time (--ready-timeout-ms); see {Path(waiting[0].member.log).parent}"
            )
        time.sleep(_POLL_S)  # a log file gives no readiness event; polled with a deadline


def log_tail(path: Path) -> str:
    """The last few lines of a log, joined on one line."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            fh.seek(max(0, fh.tell() - 4096))
            lines = fh.read().decode("utf-8", "replace").splitlines()
    except OSError as exc:
        return f"(unreadable: {exc.strerror or exc})"
    tail = [line.strip() for line in lines if line.strip()][-_TAIL_LINES:]
    return " | ".join(tail) if tail else "(empty)"


def start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), or None when it is gone or a zombie."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read().decode("ascii", "replace")
    except OSError:
        return None
    # Fields after the command name, which sits in parentheses and may hold spaces.
    fields = stat[stat.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X"):
        return None
    return int(fields[19])


def is_running(member: Member) -> bool:
    """Whether ``member``'s process still runs: its pid exists and started when it did."""
    return member.pid > 0 and start_ticks(member.pid) == member.start_ticks


@dataclass(frozen=True, slots=True)
class Stopped:
    member: Member
    how: str  # "stopped", "killed" (after the grace period), "not running"


def stop(members: Iterable[Member], timeout_s: float) -> list[Stopped]:
    """SIGTERM every running member, wait up to ``timeout_s`` for all, SIGKILL those left."""
    members = list(members)
    running = [m for m in members if is_running(m)]
    for m in running:
        _signal(m, signal.SIGTERM)
    left = _wait_gone(running, time.monotonic() + timeout_s)
    for m in left:
        _signal(m, signal.SIGKILL)
    still = _wait_gone(left, time.monotonic() + _KILL_WAIT_S)
    if still:
        names = ", ".join(f"{m.name} (pid {m.pid})" for m in still)
        raise ClusterError(f"{names} still running {_KILL_WAIT_S:.0f} s after SIGKILL; look at them with ps")
    return [Stopped(m, "not running" if m not in running else "killed" if m in left else "stopped") for m in members]


def _signal(member: Member, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):  # it exited between the check and the signal
        os.kill(member.pid, sig)


def _wait_gone(members: list[Member], deadline: float) -> list[Member]:
    left = list(members)
    while left:
        left = [m for m in left if is_running(m)]
        if not left or time.monotonic() >= deadline:
            break
        time.sleep(_POLL_S)  # another process's exit gives us no event; polled with a deadline
    return left


def child_env(log_level: str | None) -> dict[str, Any]:
    env = dict(os.environ)
    if log_level:
        env["QMQ_LOG_LEVEL"] = log_level
    return env
