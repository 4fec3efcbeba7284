"""``qmq cluster rolling-restart``: restart every process of a local cluster one at a time while it
serves (docs/cluster.md, "Rolling restart").

The order keeps every broker group and every delay group with a slave writable throughout:

1. slaves, of broker groups and of delay groups: each restarted, then waited for until it
   follows its master in the group's epoch and has copied at least what the master held when
   it came back;
2. delay servers without a slave, then gateways: each restarted and waited for until ready (and
   registered);
3. each master, of a broker group or a delay group: its slave (caught up in step 1) is promoted
   first (``POST /meta/promote``), so clients move to it and a delay group's new master hands
   over what is due; the old master is then restarted and waited for as a caught-up slave of
   the new epoch. A broker master without a slave is restarted in place (its subjects' other
   groups take the sends);
4. the meta server last, on the port it had (clients keep their last answer meanwhile, and a
   meta server just started counts nobody silent for a heartbeat timeout).

What the meta server says is read from ``GET /meta/cluster``; which process is which comes from
``DATA_DIR/cluster.json``, rewritten after every start so ``qmq cluster down`` finds the new pids.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from qmq.cli.cluster_launch import Cluster, ClusterError, Member, is_running, start, stop, wait_ready
from qmq.common.config import meta_base_url

# How often the meta server's view is read while waiting for a process (each read is one request).
_POLL_S: Final = 0.1
_ERROR_CHARS_MAX: Final = 300

Http = Callable[..., tuple[int, Any]]


@dataclass
class Restarted:
    """One process restarted: what it was and is, and how long it took to be back and caught up."""

    name: str
    role: str
    group: str | None
    before: str  # its role in the group before (master, slave) or its role
    after: str
    old_pid: int
    new_pid: int
    how: str
    took_s: float


class RollingRestart:
    """Restarts the members of ``state`` in order (module docstring), reporting each as it goes."""

    def __init__(
        self,
        state: Cluster,
        env: Mapping[str, str],
        http: Http,
        *,
        step_timeout_s: float,
        stop_timeout_s: float,
        by: str,
        echo: Callable[[str], None],
    ) -> None:
        self.state = state
        self.env = dict(env)
        self.http = http
        self.step_timeout_s = step_timeout_s
        self.stop_timeout_s = stop_timeout_s
        self.by = by
        self.echo = echo
        self.base = meta_base_url(state.meta_server)
        self.done: list[Restarted] = []

    # -- the meta server's view ------------------------------------------------------------

    def view(self) -> dict[str, Any]:
        code, doc = self.http(f"{self.base}/meta/cluster?routes_max=0")
        if code != 200 or not isinstance(doc, dict):
            raise ClusterError(f"the meta server at {self.base} answered HTTP {code}: {str(doc)[:_ERROR_CHARS_MAX]}")
        return doc

    def wait(self, what: str, ok: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """Read the view until ``ok(view)``; ClusterError naming ``what`` at the step's deadline."""
        deadline = time.monotonic() + self.step_timeout_s
        last: object = None
        while True:
            try:
                view = self.view()
            except ClusterError as exc:  # the meta server restarting: ask again
                last = exc
            else:
                if ok(view):
                    return view
                last = view
            if time.monotonic() >= deadline:
                raise ClusterError(
                    f"rolling restart stopped: {what} not within {self.step_timeout_s:g} s (--step-timeout-ms); "
                    f"the meta server last said: {str(last)[:_ERROR_CHARS_MAX]}"
                )
            time.sleep(_POLL_S)  # polling the meta server's view, bounded by the deadline

    def _row(self, view: dict[str, Any], pid: int) -> dict[str, Any] | None:
        for s in view["servers"]:
            if s["pid"] == pid and s["state"] == "available":
                return dict(s)
        return None

    def _group(self, view: dict[str, Any], role: str, group: str | None) -> dict[str, Any] | None:
        for g in view["groups"]:
            if g["role"] == role and g["group"] == group:
                return dict(g)
        return None

    # -- steps -----------------------------------------------------------------------------

    def run(self) -> list[Restarted]:
        missing = [m.name for m in self.state.members if not is_running(m)]
        if missing:
            raise ClusterError(
                f"{', '.join(missing)} of {self.state.data_dir} not running; a rolling restart keeps the cluster "
                "serving only when every process runs: start what is missing (or `qmq cluster up` anew) first"
            )
        view = self.view()
        members = [m for m in self.state.members if m.role != "meta"]

        def role_now(m: Member) -> str:
            row = self._row(view, m.pid)
            return row["role_in_group"] if row is not None else (m.role_in_group or m.role)

        replicated = ("broker", "delay")  # roles whose groups may have slaves
        slaves = [m for m in members if m.role in replicated and role_now(m) == "slave"]
        masters = [m for m in members if m.role in replicated and role_now(m) == "master"]
        with_slaves = {(g["role"], g["group"]) for g in view["groups"] if g.get("slaves")}
        alone = [m for m in masters if m.role == "delay" and (m.role, m.group) not in with_slaves]
        masters = [m for m in masters if m not in alone]
        for m in masters:
            _set_role(m, "master")  # a promoted slave comes back as the master it is
        for m in slaves:
            _set_role(m, "slave")  # it may have been started as a master, before a promotion
            self._restart_slave(m, "slave")
        for m in members:
            if m.role == "delay" and (m in alone or m not in masters + slaves):
                self._restart_in_place(m, registers=True)
        for m in members:
            if m.role == "gateway":
                self._restart_in_place(m, registers=False)
        for m in masters:
            self._restart_master(m)
        for m in self.state.members:
            if m.role == "meta":
                self._restart_meta(m)
        return self.done

    def _restart(self, m: Member) -> tuple[int, float]:
        """Stop ``m``, start it again on the ports it had, wait for its ready line."""
        old_pid = m.pid
        began = time.monotonic()
        _pin_ports(m)
        stop([m], self.stop_timeout_s)
        proc: subprocess.Popen[bytes] = start(m, self.env)
        self.state.save()  # `cluster down` must find the new pid
        wait_ready({m.name: proc}, [m], time.monotonic() + self.step_timeout_s)
        return old_pid, began

    def _record(self, m: Member, before: str, after: str, old_pid: int, how: str, began: float) -> None:
        r = Restarted(m.name, m.role, m.group, before, after, old_pid, m.pid, how, time.monotonic() - began)
        self.done.append(r)
        self.echo(f"  {r.name:<8} pid {old_pid} -> {m.pid}  {how} ({r.took_s:.1f} s)")

    def _caught_up(self, m: Member) -> None:
        """Wait until ``m`` follows its group's master in the group's epoch and has what it had."""
        target: list[int] = []

        def ok(view: dict[str, Any]) -> bool:
            row = self._row(view, m.pid)
            group = self._group(view, m.role, m.group)
            if row is None or group is None or row["role_in_group"] != "slave":
                return False
            master = next((s for s in view["servers"] if s["address"] == group["master"]), None)
            if master is None or row["epoch"] != group["epoch"] or not row["replicated_ms"]:
                return False
            if not target:
                target.append(int(master["log_end"]))  # what the master held when the slave came back
            return bool(row["log_end"] >= target[0])

        self.wait(f"{m.name} (pid {m.pid}) following its master and caught up", ok)

    def _restart_slave(self, m: Member, before: str) -> None:
        old_pid, began = self._restart(m)
        self._caught_up(m)
        self._record(m, before, "slave", old_pid, "restarted, caught up", began)

    def _restart_in_place(self, m: Member, *, registers: bool) -> None:
        old_pid, began = self._restart(m)
        if registers:
            self.wait(f"{m.name} (pid {m.pid}) registered", lambda v: self._row(v, m.pid) is not None)
        self._record(m, m.role_in_group or m.role, m.role_in_group or m.role, old_pid, "restarted", began)

    def _restart_master(self, m: Member) -> None:
        view = self.view()
        group = self._group(view, m.role, m.group)
        if group is None or not group["slaves"]:
            old_pid, began = self._restart(m)
            self.wait(
                f"{m.name} (pid {m.pid}) master again",
                lambda v: (row := self._row(v, m.pid)) is not None and row["role_in_group"] == "master",
            )
            self._record(m, "master", "master", old_pid, "restarted in place (no slave)", began)
            return
        began = time.monotonic()
        promoted = self._promote(m.role, str(m.group))
        self.wait(
            f"{m.role} group {m.group}'s new master {promoted} in charge",
            lambda v: (g := self._group(v, m.role, m.group)) is not None and g["master"] == promoted,
        )
        # Started again as what it is now: a process started `--role master` that reports the
        # group's epoch is taken for the master restarted elsewhere (docs/cluster.md).
        _set_role(m, "slave")
        old_pid, _ = self._restart(m)
        self._caught_up(m)
        self._record(m, "master", "slave", old_pid, f"{promoted} promoted first; restarted, caught up", began)

    def _promote(self, role: str, group: str) -> str:
        body = {"group": group, "role": role, "by": self.by}
        url = f"{self.base}/meta/promote"
        deadline = time.monotonic() + self.step_timeout_s
        while True:
            code, answer = self.http(url, body)
            if code == 421 and isinstance(answer, dict) and answer.get("leader"):
                url = f"{meta_base_url(str(answer['leader']))}/meta/promote"
                continue
            if code == 200 and isinstance(answer, dict):
                return str(answer["master"])
            # 409: the slave is not fresh yet (it just heartbeat late); the next heartbeat may do
            if code != 409 or time.monotonic() >= deadline:
                raise ClusterError(
                    f"rolling restart stopped: promoting {role} group {group}'s slave was refused (HTTP {code}): "
                    f"{str(answer)[:_ERROR_CHARS_MAX]}"
                )
            time.sleep(_POLL_S)  # waiting for the slave's next heartbeat, bounded by the deadline

    def _restart_meta(self, m: Member) -> None:
        old_pid, began = self._restart(m)
        self.wait(
            "every broker group available again",
            lambda v: (
                bool(v["groups"]) and all(g["state"] == "available" for g in v["groups"] if g["role"] == "broker")
            ),
        )
        self._record(m, "meta", "meta", old_pid, "restarted on its port", began)


def _pin_ports(m: Member) -> None:
    """Make ``m``'s command line bind the ports it has now (``qmq cluster up`` starts with port 0).

    The meta server must come back where every server and client looks for it; a broker or delay
    server coming back at its address keeps its one row at the meta server (a new pid there is a
    restart), rather than leaving its old address behind as a silent server.
    """
    ports: dict[str, str | None] = {}
    if m.role == "meta":
        ports["--port"] = m.ready.get("meta_server")
    elif m.role == "gateway":
        ports["--port"] = m.ready.get("gateway")
    else:
        ports["--port"] = m.ready.get("address")
        ports["--http-port"] = m.ready.get("http")
    for option, where in ports.items():
        port = _port_of(where)
        if port is None:
            continue
        if option in m.argv:
            m.argv[m.argv.index(option) + 1] = str(port)
        else:
            m.argv += [option, str(port)]


def _port_of(where: str | None) -> int | None:
    """The port of a URL or of ``host:port``; None when there is none."""
    if not where:
        return None
    try:
        return urlsplit(where if "://" in where else f"//{where}").port
    except ValueError:
        return None


def _set_role(m: Member, role_in_group: str) -> None:
    """Make ``m``'s command line (and cluster.json) start it as ``role_in_group``."""
    m.role_in_group = role_in_group
    if "--role" in m.argv:
        m.argv[m.argv.index("--role") + 1] = role_in_group
    else:
        m.argv += ["--role", role_in_group]
