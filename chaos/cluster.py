"""A qmq cluster for one scenario, started the way `qmq cluster up` starts one (its cluster.json,
so `qmq cluster down --data-dir DIR` stops it too), plus the campaign's own processes: load
workers and the outbox watchdog. Everything is stopped by ``close``, whatever happened."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qmq.cli.cluster_launch import Cluster, Member, is_running, plan, start, stop, wait_ready
from qmq.testing import write_config

READY_TIMEOUT_S = 120.0
WORKER_READY_TIMEOUT_S = 60.0
GROUPS = ("g1", "g2")

# Heartbeats every 300 ms; a master silent 2 s is replaced by its slave.
FAST: dict[str, dict[str, Any]] = {
    "meta": {"heartbeat_timeout_ms": 2_000, "client_refresh_ms": 300},
    "broker": {"heartbeat_interval_ms": 300, "slave_timeout_ms": 2_000, "checkpoint_interval_ms": 500},
    "delay": {"heartbeat_interval_ms": 300},
}

# From the producers' start until each has a send acknowledged (interpreter start, imports, the
# meta server's answer, a connection; on a loaded 2-core machine).
LOAD_START_TIMEOUT_S = 60.0


def _has_ack(history: Path) -> bool:
    """Whether a worker's history holds an acknowledged send (an ``A`` line)."""
    try:
        data = history.read_bytes()
    except FileNotFoundError:
        return False
    return data.startswith(b"A\t") or b"\nA\t" in data


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


def config(path: Path, extra: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    sections = {k: dict(v) for k, v in FAST.items()}
    for section, values in (extra or {}).items():
        sections.setdefault(section, {}).update(values)
    return write_config(path, sections)


@dataclass
class Worker:
    name: str
    argv: list[str]
    history: Path
    proc: subprocess.Popen[bytes] | None = None


@dataclass
class ChaosCluster:
    """The processes of one scenario (``start`` them, ``close`` always)."""

    data_dir: Path
    broker_groups: int = 2
    slaves: int = 1
    delay_groups: int = 1
    extra_config: Mapping[str, Mapping[str, Any]] | None = None
    env: dict[str, str] = field(default_factory=dict)
    host: str = "127.0.0.1"
    state: Cluster | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    workers: dict[str, Worker] = field(default_factory=dict)
    watchdog: subprocess.Popen[bytes] | None = None
    # per member: the command prefix and address to run it with (its own network namespace)
    placed: Mapping[str, tuple[list[str], str]] = field(default_factory=dict)
    # the meta server's URL as every other process is to use it (through a proxy, say)
    meta_url: Callable[[str], str] = lambda url: url
    # options every server gets (--auth-file ...), and the servers' own app (with $QMQ_SECRET in env)
    secure: Sequence[str] = ()
    server_app: str = ""

    @property
    def meta_server(self) -> str:
        assert self.state is not None
        return self.state.meta_server

    def child_env(self) -> dict[str, str]:
        return {**os.environ, "QMQ_LOG_LEVEL": "WARNING", **self.env}

    def start(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        cfg = config(self.data_dir / "chaos.toml", self.extra_config)
        members = plan(
            self.data_dir.resolve(),
            broker_groups=self.broker_groups,
            slaves=self.slaves,
            delay_groups=self.delay_groups,
            host=self.host,
            meta_port=free_port(self.host),
            config_file=cfg,
            secure=self.secure,
            app_code=self.server_app,
        )
        self.state = Cluster(str(self.data_dir.resolve()), "", [], int(time.time() * 1000))
        for m in members:
            if m.name in self.placed:
                prefix, host = self.placed[m.name]
                m.argv = [*prefix, *m.argv]
                m.argv[m.argv.index("--host") + 1] = host
        meta, rest = members[0], members[1:]
        masters = [m for m in rest if m.role_in_group != "slave"]
        waves = [[meta], masters, [m for m in rest if m.role_in_group == "slave"]]
        deadline = time.monotonic() + READY_TIMEOUT_S
        for wave in waves:
            if not wave:
                continue
            for m in wave:
                if m.role != "meta":
                    m.argv += ["--meta-server", self.state.meta_server]
                self.procs[m.name] = start(m, self.child_env())
                self.state.members.append(m)
                self.state.save()
            wait_ready(self.procs, wave, deadline)
            if wave[0] is meta:
                self.state.meta_server = self.meta_url(meta.ready["meta_server"])
            self.state.save()

    def member(self, name: str) -> Member:
        assert self.state is not None
        [m] = [m for m in self.state.members if m.name == name]
        return m

    def names(self, role: str | None = None) -> list[str]:
        assert self.state is not None
        return [m.name for m in self.state.members if role is None or m.role == role]

    def kill(self, name: str) -> None:
        """``kill -9`` a process of the cluster or a worker."""
        if name in self.workers:
            proc = self.workers[name].proc
            if proc is not None and proc.poll() is None:
                proc.kill()
                proc.wait()
            return
        m = self.member(name)
        if is_running(m):
            os.kill(m.pid, signal.SIGKILL)
        proc = self.procs.get(name)
        if proc is not None:
            proc.wait()

    def restart(self, name: str, timeout_s: float = READY_TIMEOUT_S) -> float:
        """Start a stopped process again with its own command line (cluster.json's ``argv``: the
        operator's one command); seconds until it printed its ready line."""
        t0 = time.monotonic()
        if name in self.workers:
            self._start_worker(self.workers[name])
            return time.monotonic() - t0
        assert self.state is not None
        m = self.member(name)
        self.procs[name] = start(m, self.child_env())
        self.state.save()
        wait_ready(self.procs, [m], time.monotonic() + timeout_s)
        return time.monotonic() - t0

    def stop_member(self, name: str) -> None:
        """SIGTERM a process of the cluster (SIGKILL after 10 s), as an operator would."""
        stop([self.member(name)], timeout_s=10.0)
        proc = self.procs.get(name)
        if proc is not None:
            proc.wait()

    def http(self, name: str) -> str:
        return self.member(name).ready["http"]

    def running(self, name: str) -> bool:
        if name in self.workers:
            proc = self.workers[name].proc
            return proc is not None and proc.poll() is None
        return is_running(self.member(name))

    # -- the load ------------------------------------------------------------------------

    def start_load(self, consumers_per_group: int = 1, producers: int = 1, rate: int = 150, tx: bool = True) -> None:
        """Consumers first (every group from the earliest message), then producers and the watchdog."""
        hist = self.data_dir / "history"
        hist.mkdir(exist_ok=True)
        base = [sys.executable, "-m", "chaos.worker"]
        for g in GROUPS:
            for i in range(1, consumers_per_group + 1):
                name = f"consumer-{g}-{i}"
                argv = [*base, "consume", "--meta-server", self.meta_server, "--group", g, "--consumer-id", f"{g}c{i}"]
                self._add_worker(name, argv, hist)
        tx_db = self.data_dir / "outbox.db"
        for i in range(1, producers + 1):
            name = f"producer-{i}"
            argv = [*base, "produce", "--meta-server", self.meta_server, "--rate", str(rate)]
            if tx:
                argv += ["--tx-db", str(tx_db)]
            self._add_worker(name, argv, hist)
        if tx:
            out = open(self.data_dir / "watchdog.out", "ab")  # noqa: SIM115 (the child keeps it)
            self.watchdog = subprocess.Popen(
                [sys.executable, "-m", "qmq", "watchdog", "--db", f"sqlite:///{tx_db}", "--meta-server",
                 self.meta_server, "--threshold-ms", "20000", "--interval-ms", "500"],
                stdin=subprocess.DEVNULL, stdout=out, stderr=out, env=self.child_env(),
            )
            out.close()
        self._wait_for_load(hist)

    def _wait_for_load(self, hist: Path) -> None:
        """Until every producer has a send acknowledged: a worker prints its ready line before it
        imports the SDK and connects, which takes seconds on a loaded machine, and a scenario that
        injects its faults meanwhile would run without load (a quick hostile_auth sent nothing)."""
        producers = [w for n, w in self.workers.items() if n.startswith("producer")]
        deadline = time.monotonic() + LOAD_START_TIMEOUT_S
        while not all(_has_ack(w.history) for w in producers):
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"the load did not start: no send acknowledged within {LOAD_START_TIMEOUT_S:.0f} s "
                    f"(see the producers' output and history in {self.data_dir} and {hist})"
                )
            time.sleep(0.1)  # the workers' progress is only in their history files

    def _add_worker(self, name: str, argv: list[str], hist: Path) -> None:
        w = Worker(name, [*argv, "--history", str(hist / f"{name}.tsv")], hist / f"{name}.tsv")
        self.workers[name] = w
        self._start_worker(w)

    def _start_worker(self, w: Worker) -> None:
        out = open(self.data_dir / f"{w.name}.out", "ab")  # noqa: SIM115 (the child keeps it)
        w.proc = subprocess.Popen(w.argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=out,
                                  env=self.child_env())
        out.close()
        assert w.proc.stdout is not None
        line = w.proc.stdout.readline()  # the worker prints its ready line before its loop
        w.proc.stdout.close()
        if not line.startswith(b"qmq ready"):
            raise RuntimeError(f"worker {w.name} did not start: see {self.data_dir / (w.name + '.out')}")

    def histories(self) -> list[Path]:
        return [w.history for w in self.workers.values()]

    def stop_producers(self) -> None:
        self._term([w for n, w in self.workers.items() if n.startswith("producer")])

    def stop_consumers(self) -> None:
        self._term([w for n, w in self.workers.items() if n.startswith("consumer")])

    def _term(self, workers: Sequence[Worker]) -> None:
        for w in workers:
            if w.proc is not None and w.proc.poll() is None:
                w.proc.send_signal(signal.SIGTERM)
        for w in workers:
            if w.proc is not None:
                try:
                    w.proc.wait(40)
                except subprocess.TimeoutExpired:
                    w.proc.kill()
                    w.proc.wait()

    def close(self) -> None:
        """Stop everything this scenario started: workers, the watchdog, the cluster."""
        for w in self.workers.values():
            if w.proc is not None and w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
        if self.watchdog is not None and self.watchdog.poll() is None:
            self.watchdog.kill()
            self.watchdog.wait()
        if self.state is not None:
            with contextlib.suppress(Exception):
                stop(self.state.members, timeout_s=10.0)
            for proc in self.procs.values():
                with contextlib.suppress(Exception):
                    proc.wait(1)
