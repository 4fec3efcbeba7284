"""A Spark standalone cluster for tests: a master and workers started from the PySpark
installation's own launch classes, each its own JVM, on 127.0.0.1.

``running_spark_cluster(work_dir, workers=2)`` starts the master (RPC port 0, web UI on a
free port), then the workers, and returns once the master's JSON status (``/json`` of its
web UI) lists every worker ALIVE; leaving the block stops them (SIGTERM, then SIGKILL past a
deadline). Each JVM logs to a file in ``work_dir`` whose tail is shown when it fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pyspark

_START_TIMEOUT_S = 120.0
_STOP_TIMEOUT_S = 30.0
_POLL_S = 0.25
_DAEMON_HEAP = "-Xmx256m"
# quick to start, small: a test cluster lives a few minutes
_FAST_JVM = ["-XX:TieredStopAtLevel=1", "-XX:+UseSerialGC"]


def spark_home() -> str:
    """The PySpark package's directory: its jars/ hold Spark's launch classes."""
    return str(Path(pyspark.__file__).parent)


def scala_version() -> str:
    """The Scala version of PySpark's jars (``2.13`` from ``spark-core_2.13-4.x.jar``)."""
    for jar in (Path(spark_home()) / "jars").glob("spark-core_*.jar"):
        return jar.name.split("_", 1)[1].split("-", 1)[0]
    raise AssertionError(f"no spark-core jar in {spark_home()}/jars: is PySpark installed whole?")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@dataclass
class Daemon:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path

    def tail(self, lines: int = 30) -> str:
        try:
            text = self.log.read_text(encoding="utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def check_alive(self) -> None:
        code = self.proc.poll()
        if code is not None:
            raise AssertionError(f"Spark {self.name} exited with status {code}:\n{self.tail()}")


@dataclass
class SparkCluster:
    url: str  # spark://127.0.0.1:<port>
    status_url: str  # the master's JSON status
    daemons: list[Daemon] = field(default_factory=list)
    work_dir: Path = Path()

    def status(self) -> dict[str, Any]:
        with urllib.request.urlopen(self.status_url, timeout=5) as answer:
            doc: dict[str, Any] = json.loads(answer.read())
            return doc

    def env(self) -> dict[str, str]:
        """Environment for a driver of this cluster (a `qmq` command run as a child process)."""
        env = dict(os.environ)
        env.update(
            {
                "SPARK_HOME": spark_home(),
                "SPARK_LOCAL_IP": "127.0.0.1",
                # executors run the package from this same environment
                "PYSPARK_PYTHON": sys.executable,
                "PYSPARK_DRIVER_PYTHON": sys.executable,
            }
        )
        return env

    def conf_args(self) -> list[str]:
        """``--spark-master`` and ``--spark-conf`` options of a `qmq` command on this cluster:
        one executor of 512 MiB and one core per worker, everything bound to 127.0.0.1."""
        conf = {
            "spark.executor.memory": "512m",
            "spark.executor.cores": "1",
            "spark.cores.max": "2",
            "spark.driver.memory": "512m",
            "spark.driver.host": "127.0.0.1",
            "spark.driver.bindAddress": "127.0.0.1",
            "spark.ui.enabled": "false",
            "spark.executor.extraJavaOptions": " ".join(_FAST_JVM),
            "spark.driver.extraJavaOptions": " ".join(_FAST_JVM),
        }
        args = ["--spark-master", self.url]
        for key, value in conf.items():
            args += ["--spark-conf", f"{key}={value}"]
        return args


def _start(name: str, argv: list[str], work_dir: Path) -> Daemon:
    log = work_dir / f"{name}.log"
    env = dict(os.environ)
    env.update(
        {
            "SPARK_HOME": spark_home(),
            "SPARK_LOCAL_IP": "127.0.0.1",
            "PYSPARK_PYTHON": sys.executable,
            # a worker builds its executors' command line with Spark's launcher, which finds
            # the jars of a pip-installed Spark only when told the Scala version
            "SPARK_SCALA_VERSION": scala_version(),
        }
    )
    with open(log, "wb") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
    return Daemon(name, proc, log)


def _java(main_class: str, *args: str) -> list[str]:
    jars = str(Path(spark_home()) / "jars" / "*")
    return [
        "java",
        _DAEMON_HEAP,
        *_FAST_JVM,
        "-Dspark.master.rest.enabled=false",  # else the master binds the fixed port 6066
        "-cp",
        jars,
        main_class,
        *args,
    ]


def _wait_for(cluster: SparkCluster, done: Any, what: str) -> dict[str, Any]:
    """Poll the master's status until ``done(status)``; between polls wait on the master
    process itself, so its exit ends the wait at once."""
    master = cluster.daemons[0]
    left = int(_START_TIMEOUT_S / _POLL_S)
    last: object = None
    while left > 0:  # bounded: _START_TIMEOUT_S
        left -= 1
        for daemon in cluster.daemons:
            daemon.check_alive()
        try:
            status = cluster.status()
            if done(status):
                return status
            last = status
        except (urllib.error.URLError, ConnectionError, TimeoutError, ValueError) as exc:
            last = exc
        try:
            master.proc.wait(_POLL_S)
        except subprocess.TimeoutExpired:
            continue
    logs = "\n".join(f"--- {d.name}\n{d.tail(15)}" for d in cluster.daemons)
    raise AssertionError(f"the Spark cluster did not reach {what} in {_START_TIMEOUT_S} s (last: {last}):\n{logs}")


def _stop(daemon: Daemon) -> None:
    if daemon.proc.poll() is None:
        daemon.proc.send_signal(signal.SIGTERM)
        try:
            daemon.proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            daemon.proc.kill()
            daemon.proc.wait()


@contextmanager
def running_spark_cluster(work_dir: Path, workers: int = 2, worker_memory: str = "1g") -> Iterator[SparkCluster]:
    """A master and ``workers`` workers (one core, ``worker_memory`` each) on 127.0.0.1."""
    work_dir.mkdir(parents=True, exist_ok=True)
    web_port = free_port()
    cluster = SparkCluster(url="", status_url=f"http://127.0.0.1:{web_port}/json/", work_dir=work_dir)
    with ExitStack() as stack:
        master = _start(
            "master",
            _java(
                "org.apache.spark.deploy.master.Master",
                "--host",
                "127.0.0.1",
                "--port",
                "0",
                "--webui-port",
                str(web_port),
            ),
            work_dir,
        )
        cluster.daemons.append(master)
        stack.callback(_stop, master)
        status = _wait_for(cluster, lambda s: s.get("status") == "ALIVE" and s.get("url"), "a live master")
        cluster.url = str(status["url"])
        for i in range(1, workers + 1):
            worker_dir = work_dir / f"worker-{i}"
            worker_dir.mkdir(exist_ok=True)
            worker = _start(
                f"worker-{i}",
                _java(
                    "org.apache.spark.deploy.worker.Worker",
                    "--host",
                    "127.0.0.1",
                    "--port",
                    "0",
                    "--webui-port",
                    "0",
                    "--cores",
                    "1",
                    "--memory",
                    worker_memory,
                    "--work-dir",
                    str(worker_dir),
                    cluster.url,
                ),
                work_dir,
            )
            cluster.daemons.append(worker)
            stack.callback(_stop, worker)

        def all_alive(s: dict[str, Any]) -> bool:
            return sum(1 for w in s.get("workers", []) if w.get("state") == "ALIVE") >= workers

        _wait_for(cluster, all_alive, f"{workers} workers ALIVE")
        yield cluster
