"""The jobs on a Spark standalone cluster (a master and two workers, each its own JVM, started
from PySpark's own classes), run through the real `qmq` command and compared with the local run.

Runs in CI like every test here: nothing is skipped when Java or PySpark is there, and both
are part of the test environment.
"""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner
from followhelpers import FollowProcess, committed_offsets
from pyspark.sql import SparkSession
from sparkcluster import SparkCluster, running_spark_cluster
from sparkhelpers import send_messages

from qmq.spark.archive import run_archive
from qmq.testing import ReadyProcess, running_standalone
from qmq.testing.processes import qmq_argv

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.spark_cluster, pytest.mark.timeout(900)]

_COMMAND_TIMEOUT_S = 300
SUBJECTS = ("cluster.orders", "cluster.refunds", "cluster.audit")
_ROW_COLUMNS = "subject, broker_group, sequence, message_id, tags, properties, body, created_at, stored_at, date"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SparkCluster]:
    with running_spark_cluster(tmp_path_factory.mktemp("spark-cluster")) as c:
        yield c


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    """A qmq of this module's own: both runs of a job see exactly the same messages."""
    with running_standalone(tmp_path_factory.mktemp("cluster-qmq") / "data") as proc:
        yield proc


@dataclass
class Sent:
    ids: dict[str, list[str]]


@pytest.fixture(scope="module")
def sent(server: ReadyProcess) -> Sent:
    return Sent({s: send_messages(server.meta_server, s, 300 + 50 * i) for i, s in enumerate(SUBJECTS)})


def on_cluster(cluster: SparkCluster, *args: str) -> str:
    """Run ``qmq ARGS`` as a child process, its driver talking to the cluster; its stdout."""
    argv = qmq_argv(*args, *cluster.conf_args())
    done = subprocess.run(
        argv, env=cluster.env(), capture_output=True, timeout=_COMMAND_TIMEOUT_S, stdin=subprocess.DEVNULL
    )
    err = done.stderr.decode("utf-8", "replace")
    assert done.returncode == 0, f"{argv} exited with {done.returncode}:\n{err[-4000:]}"
    return done.stdout.decode("utf-8")


@contextmanager
def local_commands(spark: SparkSession, monkeypatch: pytest.MonkeyPatch) -> Iterator[CliRunner]:
    """The same commands in this process, on the suite's local session."""
    from qmq.cli import spark_commands

    @contextmanager
    def test_session(master: str, app: str, conf: dict[str, str] | None = None) -> Iterator[SparkSession]:
        yield spark

    monkeypatch.setattr(spark_commands, "_session", test_session)
    yield CliRunner()


def locally(runner: CliRunner, *args: str) -> str:
    from qmq.cli.main import cli

    result = runner.invoke(cli, list(args))
    assert result.exit_code == 0, result.output
    return result.stdout


def archived_rows(spark: SparkSession, archive: Path) -> list[tuple[Any, ...]]:
    df = spark.read.parquet(str(archive)).selectExpr(*(c.strip() for c in _ROW_COLUMNS.split(",")))
    return sorted(tuple(_plain(v) for v in row) for row in df.collect())


def _plain(value: Any) -> Any:
    """A column's value in a form that sorts: maps and arrays as tuples."""
    if isinstance(value, dict):
        return tuple(sorted(value.items()))
    if isinstance(value, list):
        return tuple(value)
    return value


def without(doc: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: v for k, v in doc.items() if k not in keys}


def test_the_cluster_has_two_live_workers(cluster: SparkCluster) -> None:
    status = cluster.status()
    assert status["status"] == "ALIVE"
    assert [w["state"] for w in status["workers"]] == ["ALIVE", "ALIVE"]
    assert all(w["host"] == "127.0.0.1" for w in status["workers"])


def test_archive_report_and_query_on_the_cluster_equal_the_local_run(
    cluster: SparkCluster,
    server: ReadyProcess,
    sent: Sent,
    spark: SparkSession,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    meta = server.meta_server
    on_disk = tmp_path / "on-cluster"
    here = tmp_path / "local"
    remote = json.loads(on_cluster(cluster, "archive", "--meta-server", meta, "--to", str(on_disk), "--json"))
    with local_commands(spark, monkeypatch) as runner:
        local = json.loads(locally(runner, "archive", "--meta-server", meta, "--to", str(here), "--json"))
        assert remote["per_subject"] == local["per_subject"] == {s: len(ids) for s, ids in sent.ids.items()}
        assert without(remote, "archive", "seconds") == without(local, "archive", "seconds")
        # the cluster's executors wrote the same rows, partitioned the same way
        assert archived_rows(spark, on_disk) == archived_rows(spark, here)
        assert sorted(p.name for p in on_disk.glob("subject=*")) == sorted(p.name for p in here.glob("subject=*"))

        remote_report = json.loads(on_cluster(cluster, "report", "--archive", str(on_disk), "--json"))
        local_report = json.loads(locally(runner, "report", "--archive", str(here), "--json"))
        assert remote_report["rows"] == local_report["rows"]
        assert [r["messages"] for r in remote_report["rows"]] == [len(sent.ids[s]) for s in sorted(SUBJECTS)]

        # one query on the cluster (each command is a driver and two executors started: ~15 s);
        # a query by id reads the archive the same way, and is run on the local session elsewhere
        by_subject = ["query", "--archive", str(on_disk), "--subject", "cluster.audit", "--property", "i=7", "--json"]
        remote_found = on_cluster(cluster, *by_subject).splitlines()
        by_subject[2] = str(here)
        assert remote_found == locally(runner, *by_subject).splitlines()
        assert [json.loads(line)["message_id"] for line in remote_found] == [sent.ids["cluster.audit"][7]]
    # the jobs ran on the cluster: the master saw each command as an application
    apps = [a["name"] for a in cluster.status()["completedapps"]]
    for name in ("qmq archive", "qmq report", "qmq query"):
        assert name in apps, apps


def test_the_continuous_archive_on_the_cluster_equals_a_local_batch_archive(
    cluster: SparkCluster, server: ReadyProcess, sent: Sent, spark: SparkSession, tmp_path: Path
) -> None:
    """A stream through the meta server, read by the cluster's executors, micro-batch by micro-batch."""
    meta = server.meta_server
    followed = tmp_path / "followed"
    args = ("--trigger-interval", "1s", *cluster.conf_args())
    follow = FollowProcess(followed, ("--meta-server", meta), args, env=cluster.env())
    follow.wait_for(lambda: len(follow.lines) > 0, "a first micro-batch")
    late = send_messages(meta, "cluster.late", 40)  # sent while it runs
    want = {("broker-1", s): len(ids) for s, ids in sent.ids.items()} | {("broker-1", "cluster.late"): len(late)}
    follow.wait_for(lambda: committed_offsets(followed) == want, f"commit of {want}")
    assert follow.terminate() == 0, follow.stderr()
    assert sum(line["messages"] for line in follow.lines) == sum(want.values())
    here = tmp_path / "local"
    run_archive(spark, {"meta_server": meta}, here)
    assert archived_rows(spark, followed) == archived_rows(spark, here)
    assert "qmq archive --follow" in [a["name"] for a in cluster.status()["completedapps"]]
