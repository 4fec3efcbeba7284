"""Helpers of the cluster tests: the ``qmq`` command line, a cluster started with ``qmq cluster up``
and always stopped afterwards, and what its meta server says (``GET /meta/cluster``).

A helper module, not a conftest: test modules import it by name (it sits beside them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from qmq.aio import Message, Producer
from qmq.cli.admin import ask_every_broker
from qmq.cli.cluster_launch import Cluster, is_running, stop
from qmq.protocol.codes import RequestCode
from qmq.testing import write_config

# Interpreter starts and imports of six processes on a busy 2-core machine.
UP_TIMEOUT_S = 120.0
CLI_TIMEOUT_S = 60.0


def qmq_argv(*args: str) -> list[str]:
    return [sys.executable, "-m", "qmq", *args]


def run_qmq(*args: str, timeout_s: float = CLI_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, QMQ_LOG_LEVEL="WARNING")
    return subprocess.run(
        qmq_argv(*args), capture_output=True, text=True, timeout=timeout_s, env=env, stdin=subprocess.DEVNULL
    )


def ready_pairs(stdout: str) -> dict[str, str]:
    [line] = [line for line in stdout.splitlines() if line.startswith("qmq ready")]
    return dict(p.split("=", 1) for p in line.split()[2:] if "=" in p)


@dataclass
class LocalCluster:
    """A cluster started by ``qmq cluster up``: its ready line, its cluster file, its meta server."""

    data_dir: Path
    ready: dict[str, str]
    stdout: str

    @property
    def meta_server(self) -> str:
        return self.ready["meta_server"]

    @property
    def base_url(self) -> str:
        return self.meta_server.removesuffix("/meta/address")

    def file(self) -> Cluster:
        return Cluster.load(self.data_dir)

    def member(self, name: str) -> Any:
        [m] = [m for m in self.file().members if m.name == name]
        return m

    def view(self) -> dict[str, Any]:
        """``GET /meta/cluster`` of its meta server."""
        with urllib.request.urlopen(f"{self.base_url}/meta/cluster", timeout=10) as resp:
            doc: dict[str, Any] = json.load(resp)
            return doc

    def wait_view(self, what: str, ok: Callable[[dict[str, Any]], bool], timeout_s: float = 30.0) -> dict[str, Any]:
        """Ask the meta server until ``ok(view)``; fail at the deadline with the last view (or error)."""
        deadline = time.monotonic() + timeout_s
        view: dict[str, Any] | OSError = {}
        while True:
            try:
                view = self.view()
            except OSError as exc:  # not answering (yet): restarting, say
                view = exc
            if isinstance(view, dict) and ok(view):
                return view
            if time.monotonic() >= deadline:
                raise AssertionError(f"{what}: not so within {timeout_s} s; the meta server says {view}")
            time.sleep(0.05)  # polling the meta server's view, bounded by the deadline


def fast_config(path: Path, sections: Mapping[str, Mapping[str, Any]] | None = None) -> Path:
    """A config file for tests: heartbeats every 300 ms, a group silent 2 s is unavailable."""
    base: dict[str, dict[str, Any]] = {
        "meta": {"heartbeat_timeout_ms": 2_000, "client_refresh_ms": 300},
        "broker": {"heartbeat_interval_ms": 300, "slave_timeout_ms": 2_000, "checkpoint_interval_ms": 500},
        "delay": {"heartbeat_interval_ms": 300},
    }
    for section, values in (sections or {}).items():
        base.setdefault(section, {}).update(values)
    return write_config(path, base)


@contextmanager
def cluster_up(data_dir: Path, args: Sequence[str] = (), config: Path | None = None) -> Iterator[LocalCluster]:
    """``qmq cluster up --data-dir DATA_DIR ARGS``; stopped afterwards (``down``, then whatever is left)."""
    extra = [*args, *(["--config", str(config)] if config else [])]
    done = run_qmq("cluster", "up", "--data-dir", str(data_dir), *extra, timeout_s=UP_TIMEOUT_S)
    try:
        assert done.returncode == 0, f"cluster up exited {done.returncode}: {done.stderr}"
        yield LocalCluster(data_dir, ready_pairs(done.stdout), done.stdout)
    finally:
        if (data_dir / "cluster.json").exists():
            members = Cluster.load(data_dir).members
            run_qmq("cluster", "down", "--data-dir", str(data_dir), "--timeout-ms", "10000")
            stop([m for m in members if is_running(m)], timeout_s=5.0)  # what down could not stop


async def sent_one_by_one(meta_server: str, subject: str, n: int) -> list[Message]:
    """Group "g" of ``subject`` made on every broker group (from the earliest message, so LAG
    counts every message), then ``n`` messages sent one at a time: each may go to any group."""
    pull = {"subject": subject, "group": "g", "consumer_id": "c", "session": "s", "max": 1, "start": "earliest"}
    await ask_every_broker(meta_server, RequestCode.PULL, pull)
    async with Producer(app_code="shop", meta_server=meta_server) as first:
        messages = [first.generate_message(subject) for _ in range(n)]
        for m in messages:
            await first.send(m)
    return messages


async def stored_by_group(meta_server: str, subject: str) -> dict[str, int]:
    """Messages of ``subject`` each broker group stores (its LAG answer for group "g")."""
    answers = await ask_every_broker(meta_server, RequestCode.LAG, {"subject": subject, "group": "g"})
    assert all(isinstance(a, dict) for a in answers.values()), answers
    return {name: int(a["messages"]) for name, a in answers.items() if isinstance(a, dict)}
