"""Writes: rows become messages; a retried task sends the same ids, so nothing is stored twice."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pytest
from pyspark import TaskContext
from pyspark.sql import SparkSession
from sparkhelpers import send_messages

from qmq.common.errors import ConfigError
from qmq.testing import ReadyProcess, metric_value

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

_SCHEMA = pa.schema([("body", pa.string()), ("subject", pa.string())])
_ARROW_BATCH_ROWS = "spark.sql.execution.arrow.maxRecordsPerBatch"


def _read(spark: SparkSession, meta_server: str, subject: str) -> list[dict[str, object]]:
    df = spark.read.format("qmq").option("meta_server", meta_server).option("subscribe", subject).load()
    return [r.asDict() for r in df.orderBy("sequence").collect()]


def test_rows_become_messages_with_their_subject_tags_and_properties(
    spark: SparkSession, meta_server: str, subject: str
) -> None:
    other = subject + ".other"
    df = spark.createDataFrame(
        [
            ("hello", None, ["a", "b"], {"k": "v"}, None),
            ("world", other, None, None, "my-id-1"),
        ],
        "body string, subject string, tags array<string>, properties map<string,string>, message_id string",
    )
    df.write.format("qmq").option("meta_server", meta_server).option("subject", subject).mode("append").save()
    [mine] = _read(spark, meta_server, subject)
    assert mine["body"] == b"hello"
    assert mine["tags"] == ["a", "b"]
    assert mine["properties"] == {"k": "v"}
    # a generated id carries the time of the write, as ids the SDK makes do
    assert mine["message_id"][:15].isdigit()
    [theirs] = _read(spark, meta_server, other)
    assert (theirs["body"], theirs["message_id"]) == (b"world", "my-id-1")


def test_a_retried_write_task_stores_each_message_once(
    spark: SparkSession, shared_standalone: ReadyProcess, subject: str, tmp_path: Path
) -> None:
    """The first attempt of partition 0 hands its 200 rows to the writer, which sends them, and
    then fails on a row it cannot send; Spark retries the task, which sends the same ids again,
    and the broker's duplicate window drops every one of them."""
    meta_server = shared_standalone.meta_server
    broker_http = shared_standalone.ready["broker_http"]
    marker = tmp_path / "failed-once"

    def rows_then_a_bad_one_at_first(batches: Iterator[pa.RecordBatch]) -> Iterator[pa.RecordBatch]:
        ctx = TaskContext.get()
        assert ctx is not None
        attempt = ctx.attemptNumber()
        for batch in batches:  # each body says which attempt sent it: "<row>@<attempt>"
            bodies = [f"{body}@{attempt}" for body in batch.column("body").to_pylist()]
            yield pa.RecordBatch.from_arrays([pa.array(bodies), pa.nulls(len(bodies), pa.string())], _SCHEMA)
        if ctx.partitionId() == 0 and attempt == 0:
            marker.touch()
            # in a batch of its own, after the rows (maxRecordsPerBatch): the writer fails on it
            # once it has handed the 200 rows to its producer, which still sends them
            yield pa.RecordBatch.from_arrays([pa.array(["bad"]), pa.array(["not a subject"])], _SCHEMA)

    duplicates_before = metric_value(broker_http, "qmq_duplicates_total")
    rows = spark.range(0, 400, numPartitions=2).selectExpr("CAST(id AS STRING) AS body")
    flaky = rows.mapInArrow(rows_then_a_bad_one_at_first, "body string, subject string")
    spark.conf.set(_ARROW_BATCH_ROWS, "100")
    try:
        flaky.write.format("qmq").option("meta_server", meta_server).option("subject", subject).mode("append").save()
    finally:
        spark.conf.unset(_ARROW_BATCH_ROWS)
    assert marker.exists(), "the write task never failed, so nothing was retried"
    stored = _read(spark, meta_server, subject)
    bodies = [bytes(r["body"]).decode().split("@") for r in stored]  # type: ignore[arg-type]
    assert sorted(int(row) for row, _attempt in bodies) == list(range(400))
    assert len({r["message_id"] for r in stored}) == 400
    # Every copy stored is a first attempt's, the failed one's included: the retry's were dropped...
    assert {attempt for _row, attempt in bodies} == {"0"}
    # ...by the broker's duplicate window, which saw each of partition 0's 200 rows again.
    assert metric_value(broker_http, "qmq_duplicates_total") - duplicates_before == 200


def test_a_stream_of_messages_writes_a_stream_of_messages(
    spark: SparkSession, meta_server: str, subject: str, tmp_path: Path
) -> None:
    send_messages(meta_server, subject, 60)
    target = subject + ".copy"
    query = (
        spark.readStream.format("qmq")
        .option("meta_server", meta_server)
        .option("subscribe", subject)
        .option("startingOffsets", "earliest")
        .load()
        .select("body", "properties")
        .writeStream.format("qmq")
        .option("meta_server", meta_server)
        .option("subject", target)
        .option("checkpointLocation", str(tmp_path / "checkpoint"))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(120)
    copied = _read(spark, meta_server, target)
    assert sorted(r["properties"]["i"] for r in copied) == sorted(str(i) for i in range(60))  # type: ignore[index]
    assert all(str(r["message_id"]).startswith("q") for r in copied)


def test_a_write_without_a_body_column_is_refused_on_the_driver(spark: SparkSession, meta_server: str) -> None:
    df = spark.createDataFrame([("x",)], "payload string")
    with pytest.raises(Exception, match="no body column") as info:
        df.write.format("qmq").option("meta_server", meta_server).option("subject", "s").mode("append").save()
    assert "select or rename one" in str(info.value)
    assert ConfigError.__name__ in str(info.value)
