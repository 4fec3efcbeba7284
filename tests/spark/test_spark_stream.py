"""Streaming reads: offsets per (broker group, subject) in the checkpoint, restart without loss or repeat."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pyspark.sql import DataFrame, SparkSession
from sparkhelpers import send_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

_QUERY_TIMEOUT_S = 120


def _run_stream(
    spark: SparkSession, meta_server: str, subject: str, checkpoint: Path, seen: dict[int, list[str]], runs: list[int]
) -> Any:
    def collect(batch: DataFrame, batch_id: int) -> None:
        runs.append(batch_id)
        ids = sorted(r.message_id for r in batch.select("message_id").collect())
        if batch_id in seen:  # a replayed micro-batch must read exactly what it read the first time
            assert seen[batch_id] == ids, f"micro-batch {batch_id} read other messages when replayed"
        seen[batch_id] = ids

    query = (
        spark.readStream.format("qmq")
        .option("meta_server", meta_server)
        .option("subscribe", subject)
        .option("startingOffsets", "earliest")
        .option("maxOffsetsPerTrigger", "100")
        .load()
        .writeStream.foreachBatch(collect)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(_QUERY_TIMEOUT_S), "the stream did not finish the messages available"
    assert query.exception() is None
    return query


def test_a_stream_restarted_from_its_checkpoint_neither_skips_nor_repeats(
    spark: SparkSession, meta_server: str, subject: str, tmp_path: Path
) -> None:
    checkpoint = tmp_path / "checkpoint"
    seen: dict[int, list[str]] = {}
    runs: list[int] = []
    first = send_messages(meta_server, subject, 250)
    query = _run_stream(spark, meta_server, subject, checkpoint, seen, runs)
    sizes = [p["numInputRows"] for p in query.recentProgress if p["numInputRows"]]
    assert sizes == [100, 100, 50]  # maxOffsetsPerTrigger bounds each micro-batch
    # stopped in the middle of its last micro-batch: planned (offset log), never committed
    last = max(int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit())
    (checkpoint / "commits" / str(last)).unlink()
    (checkpoint / "commits" / f".{last}.crc").unlink(missing_ok=True)
    second = send_messages(meta_server, subject, 120, start=250)
    _run_stream(spark, meta_server, subject, checkpoint, seen, runs)
    assert runs.count(last) == 2  # the uncommitted micro-batch ran again, reading the same messages
    got = [i for ids in seen.values() for i in ids]
    assert sorted(got) == sorted(first + second)
    assert len(got) == len(set(got))


def test_a_stream_from_latest_reads_only_what_comes_after_it_started(
    spark: SparkSession, meta_server: str, subject: str, tmp_path: Path
) -> None:
    send_messages(meta_server, subject, 30)
    checkpoint = tmp_path / "checkpoint"
    rows: list[str] = []
    stream = spark.readStream.format("qmq").option("meta_server", meta_server).option("subscribe", subject).load()
    query = (
        stream.writeStream.foreachBatch(lambda df, _bid: rows.extend(r.message_id for r in df.collect()))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(_QUERY_TIMEOUT_S)
    assert rows == []
    later = send_messages(meta_server, subject, 5, start=30)
    query = (
        stream.writeStream.foreachBatch(lambda df, _bid: rows.extend(r.message_id for r in df.collect()))
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )
    assert query.awaitTermination(_QUERY_TIMEOUT_S)
    assert sorted(rows) == sorted(later)
