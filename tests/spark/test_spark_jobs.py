"""The jobs behind qmq archive / query / trace / report, against a running qmq."""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from click.testing import CliRunner
from pyspark.sql import SparkSession
from sparkhelpers import send_messages

import qmq
from qmq.spark.archive import ArchiveState, run_archive
from qmq.spark.query import SubjectQuery, find_by_id, find_by_subject
from qmq.spark.report import run_report
from qmq.spark.trace import trace

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

GROUP = "billing"


@dataclass
class Story:
    subject: str
    ids: list[str]
    failed_id: str
    archive: Path


def _pull_until(pull: qmq.client.sync.PullConsumer, want: int) -> list[qmq.client.sync.ReceivedMessage]:  # type: ignore[name-defined]
    got: list[qmq.client.sync.ReceivedMessage] = []  # type: ignore[name-defined]
    for _ in range(60):  # long polls of at most a second each
        got.extend(pull.pull(max_messages=100, timeout_ms=1_000))
        if len(got) >= want:
            break
    return got


@pytest.fixture(scope="module")
def story(
    spark: SparkSession, shared_standalone: qmq.testing.ReadyProcess, tmp_path_factory: pytest.TempPathFactory
) -> Story:
    """Ten messages; consumer c1 of group billing acks nine and fails one twice, so it is
    retried once and then dead-lettered; everything is archived."""
    meta_server = shared_standalone.meta_server
    subject = f"jobs.{tmp_path_factory.mktemp('x').name}".replace("-", "")
    ids = send_messages(meta_server, subject, 10)
    failed = ids[3]
    with qmq.Consumer(app_code="jobs", meta_server=meta_server, consumer_id="c1") as consumer:
        pull = consumer.pull_consumer(subject, GROUP, start_from="earliest", max_retries=1, retry_backoff=[0.01])
        for m in _pull_until(pull, 10):
            if m.message_id == failed:
                m.nack(RuntimeError("card declined"))
            else:
                m.ack()
        for m in _pull_until(pull, 1):  # the retry, attempt 2
            assert m.message_id == failed
            m.nack(RuntimeError("card declined again"))
        pull.pull(max_messages=1, timeout_ms=0)  # carries the last acks
    archive = tmp_path_factory.mktemp("archive")
    run_archive(spark, {"meta_server": meta_server}, archive)
    return Story(subject, ids, failed, archive)


def test_an_archive_run_adds_only_what_is_new(spark: SparkSession, story: Story, meta_server: str) -> None:
    before = spark.read.parquet(str(story.archive)).where(f"subject = '{story.subject}'").count()
    assert before == 10
    more = send_messages(meta_server, story.subject, 5, start=10)
    result = run_archive(spark, {"meta_server": meta_server}, story.archive)
    assert result.per_subject.get(story.subject) == 5
    again = run_archive(spark, {"meta_server": meta_server}, story.archive)
    assert story.subject not in again.per_subject
    rows = spark.read.parquet(str(story.archive)).where(f"subject = '{story.subject}'").collect()
    assert sorted(r.message_id for r in rows) == sorted(story.ids + more)
    assert {r.date for r in rows} == {rows[0].created_at.date()}
    assert ArchiveState.load(story.archive).offsets[("broker-1", story.subject)] == 15


def test_query_finds_a_message_by_id_and_messages_by_subject_and_property(spark: SparkSession, story: Story) -> None:
    [found] = find_by_id(spark, story.archive, story.ids[5])
    assert (found["subject"], found["sequence"], found["properties"]) == (story.subject, 5, {"i": "5"})
    assert found["created_at"].endswith("Z") or found["created_at"].endswith("+00:00")
    assert find_by_id(spark, story.archive, "991231235959999.nothing.1.1") == []
    odd = find_by_subject(spark, story.archive, SubjectQuery(story.subject, properties=(("i", "7"),)))
    assert [r["message_id"] for r in odd] == [story.ids[7]]
    some = find_by_subject(spark, story.archive, SubjectQuery(story.subject, since="2000-01-01T00:00:00", limit=3))
    assert [r["sequence"] for r in some] == [0, 1, 2]


def test_trace_tells_the_life_of_a_message_from_the_brokers_files(
    spark: SparkSession, story: Story, data_dir: str
) -> None:
    t = trace(spark, story.failed_id, data_dir=data_dir, archive=story.archive)
    where = {(s.subject, s.attempt) for s in t.stored if s.found_in == "data dir, archive"}
    assert (story.subject, 1) in where  # a first send is attempt 1
    retry_subject = f"%RETRY%{story.subject}%{GROUP}"
    [retry] = [s for s in t.stored if s.subject == retry_subject and "data dir" in s.found_in]
    assert retry.attempt == 2
    assert "card declined" in (retry.error or "")
    first = [d for d in t.deliveries if d.subject == story.subject]
    assert [(d.consumer_group, d.consumer_id) for d in first] == [(GROUP, "c1")]
    assert first[0].acked  # acknowledged once its retry copy was stored
    assert any(d.subject == retry_subject and d.consumer_id == "c1" for d in t.deliveries)
    [dead] = t.dead
    assert (dead.consumer_group, dead.removed) == (GROUP, False)
    assert "card declined again" in (dead.error or "")
    assert json.loads(t.to_json())["message_id"] == story.failed_id


def test_report_counts_messages_retries_dead_letters_and_lag(spark: SparkSession, story: Story, tmp_path: Path) -> None:
    target, rows = run_report(spark, story.archive, tmp_path / "report")
    mine = [r for r in rows if r["subject"] == story.subject]
    assert sum(r["messages"] for r in mine) == 15
    assert sum(r["retries"] for r in mine) == 1
    assert sum(r["dead_letters"] for r in mine) == 1
    assert mine[-1]["consumer_lag"] is not None
    assert spark.read.parquet(str(target)).where(f"subject = '{story.subject}'").count() == len(mine)


def test_the_commands_print_summaries_and_json(
    spark: SparkSession, story: Story, data_dir: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmq.cli import spark_commands
    from qmq.cli.main import cli

    @contextmanager
    def test_session(master: str, app: str, conf: dict[str, str] | None = None) -> Iterator[SparkSession]:
        yield spark  # the suite's session, not stopped by the command

    monkeypatch.setattr(spark_commands, "_session", test_session)
    runner = CliRunner()
    archive = tmp_path / "archive"
    result = runner.invoke(cli, ["archive", "--data-dir", data_dir, "--to", str(archive)])
    assert result.exit_code == 0, result.output
    assert "messages of" in result.output
    result = runner.invoke(cli, ["query", "--archive", str(archive), "--message-id", story.ids[1], "--json"])
    assert result.exit_code == 0, result.output
    [line] = result.output.strip().splitlines()
    assert json.loads(line)["body"] == "00000000000000000001"
    result = runner.invoke(cli, ["trace", story.failed_id, "--data-dir", data_dir])
    assert result.exit_code == 0, result.output
    assert "pulled by consumer c1 of group billing" in result.output
    result = runner.invoke(cli, ["report", "--archive", str(archive)])
    assert result.exit_code == 0, result.output
    assert "row(s) written to" in result.output
    assert spark.read.parquet(str(archive / "_report")).where(f"subject = '{story.subject}'").count() == 1
    result = runner.invoke(cli, ["query", "--archive", str(archive)])
    assert result.exit_code != 0
    assert "--message-id or --subject" in result.output
    # --json: one document from archive, trace and report (a re-run of the archive adds only what is new)
    result = runner.invoke(cli, ["archive", "--data-dir", data_dir, "--to", str(archive), "--json"])
    assert result.exit_code == 0, result.output
    done = json.loads(result.stdout)
    assert done["archive"] == str(archive)
    assert done["messages"] == sum(done["per_subject"].values())
    result = runner.invoke(cli, ["trace", story.failed_id, "--data-dir", data_dir, "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["message_id"] == story.failed_id
    result = runner.invoke(cli, ["report", "--archive", str(archive), "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["written_to"] == str(archive / "_report")
    assert sum(r["messages"] for r in report["rows"] if r["subject"] == story.subject) == 15
