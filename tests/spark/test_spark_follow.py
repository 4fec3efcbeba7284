"""The continuous archive through the real command: ``qmq archive --follow`` started, stopped
with Ctrl-C and SIGTERM, killed with SIGKILL mid-batch, restarted, and mixed with batch
``qmq archive`` runs; every message sent before, during and between runs is archived once."""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from followhelpers import FollowProcess, committed_offsets
from pyspark.sql import SparkSession
from sparkhelpers import send_messages

from qmq.spark.archive import run_archive
from qmq.spark.ledger import Ledger
from qmq.spark.query import find_by_id
from qmq.spark.report import run_report
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(900)]

GROUP = "broker-1"
# two cores for the command's Spark, micro-batches every second, a JVM quick to start
FOLLOW_ARGS = (
    "--spark-master",
    "local[2]",
    "--trigger-interval",
    "1s",
    "--spark-conf",
    "spark.driver.extraJavaOptions=-XX:TieredStopAtLevel=1 -XX:+UseSerialGC",
)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    """A qmq of this module's own: the archive holds exactly what the test sent."""
    with running_standalone(tmp_path_factory.mktemp("follow-qmq") / "data") as proc:
        yield proc


class Sent:
    def __init__(self, meta_server: str) -> None:
        self.meta_server = meta_server
        self.ids: dict[str, list[str]] = {}

    def send(self, subject: str, n: int) -> None:
        have = self.ids.setdefault(subject, [])
        have += send_messages(self.meta_server, subject, n, start=len(have))

    def offsets(self) -> dict[tuple[str, str], int]:
        return {(GROUP, s): len(ids) for s, ids in self.ids.items()}


def all_archived(follow: FollowProcess, sent: Sent) -> None:
    """Wait for the commit of everything sent (by this run or another)."""
    want = sent.offsets()
    follow.wait_for(
        lambda: {p: n for p, n in committed_offsets(follow.to).items() if p in want} == want,
        f"commit of {want}",
    )


def lines_say(follow: FollowProcess, messages: int) -> None:
    """Wait for the progress lines of this run to add up to ``messages``."""
    follow.wait_for(lambda: sum(line["messages"] for line in follow.lines) >= messages, f"lines of {messages}")
    assert sum(line["messages"] for line in follow.lines) == messages


def workspace_with_data(archive: Path) -> bool:
    """A micro-batch is being written: a workspace holds Spark's files of it."""
    work = archive / "_qmq" / "work"
    if not work.is_dir():
        return False
    for name in os.listdir(work):
        ws = work / name
        if ws.is_dir() and any(p.name == "_temporary" or p.name.startswith("subject=") for p in ws.iterdir()):
            return True
    return False


def test_every_message_is_archived_once_across_stops_crashes_restarts_and_batch_runs(
    server: ReadyProcess, spark: SparkSession, tmp_path: Path
) -> None:
    sent = Sent(server.meta_server)
    archive = tmp_path / "archive"
    source = ("--meta-server", server.meta_server)

    # before the first run, and during it
    sent.send("f.orders", 200)
    sent.send("f.refunds", 100)
    first = FollowProcess(archive, source, FOLLOW_ARGS)
    all_archived(first, sent)
    sent.send("f.orders", 80)
    all_archived(first, sent)
    lines_say(first, 380)
    assert first.interrupt() == 0, first.stderr()  # Ctrl-C
    assert "stopped:" in first.stderr()
    assert first.lines[-1]["lag"] == 0
    assert {"batch", "manifest", "subjects", "per_subject", "lag", "seconds"} <= set(first.lines[0])

    # between runs: a batch `qmq archive` run takes what came meanwhile
    sent.send("f.refunds", 60)
    assert run_archive(spark, {"meta_server": server.meta_server}, archive).per_subject == {"f.refunds": 60}
    sent.send("f.audit", 40)

    # a run killed with SIGKILL while a micro-batch is being written
    second = FollowProcess(archive, source, (*FOLLOW_ARGS, "--max-per-batch", "100"))
    all_archived(second, sent)
    lines_say(second, 40)  # the batch run's 60 are not read again
    sent.send("f.orders", 700)
    second.wait_for(lambda: workspace_with_data(archive), "a micro-batch being written", timeout_s=120)
    second.crash()
    rows = spark.read.parquet(str(archive)).select("message_id").collect()
    assert not [i for i, n in Counter(r.message_id for r in rows).items() if n > 1]

    # between runs again, then a run with a batch run beside it, stopped with SIGTERM
    sent.send("f.refunds", 30)
    third = FollowProcess(archive, source, FOLLOW_ARGS)
    third.wait_for(lambda: len(third.lines) > 0, "a first micro-batch")  # it runs from here
    sent.send("f.audit", 25)
    run_archive(spark, {"meta_server": server.meta_server}, archive)  # beside it
    sent.send("f.orders", 20)
    all_archived(third, sent)
    assert third.terminate() == 0, third.stderr()

    # every message once, the bookkeeping clean, and the other jobs read the archive unchanged
    got = spark.read.parquet(str(archive)).select("subject", "message_id").collect()
    for subject, ids in sent.ids.items():
        archived = [r.message_id for r in got if r.subject == subject]
        assert len(archived) == len(ids), subject
        assert sorted(archived) == sorted(ids), subject
    state = Ledger(archive).load()
    assert state.offsets == sent.offsets()
    assert os.listdir(archive / "_qmq" / "work") == []
    [found] = find_by_id(spark, archive, sent.ids["f.orders"][600])
    assert (found["subject"], found["sequence"]) == ("f.orders", 600)
    _target, report = run_report(spark, archive, tmp_path / "report")
    assert {r["subject"]: r["messages"] for r in report} == {s: len(ids) for s, ids in sent.ids.items()}
