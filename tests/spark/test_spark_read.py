"""Batch reads of the qmq data source against a running qmq: through the brokers and offline."""

from __future__ import annotations

import json

import pytest
from pyspark.sql import SparkSession
from sparkhelpers import send_messages

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_batch_read_returns_every_stored_message_with_its_fields(
    spark: SparkSession, meta_server: str, subject: str
) -> None:
    ids = send_messages(meta_server, subject, 300)
    df = (
        spark.read.format("qmq")
        .option("meta_server", meta_server)
        .option("subscribe", subject)
        .option("maxRecordsPerPartition", "100")
        .load()
    )
    assert df.schema.simpleString() == (
        "struct<subject:string,broker_group:string,sequence:bigint,message_id:string,tags:array<string>,"
        "properties:map<string,string>,body:binary,created_at:timestamp,stored_at:timestamp>"
    )
    rows = sorted(df.collect(), key=lambda r: r.sequence)
    assert [r.message_id for r in rows] == ids
    assert [r.sequence for r in rows] == list(range(300))
    assert rows[7].properties == {"i": "7"}
    assert rows[7].tags == ["odd"]
    assert rows[7].body == b"00000000000000000007"
    assert {r.subject for r in rows} == {subject}
    assert {r.broker_group for r in rows} == {"broker-1"}
    assert all(r.stored_at >= r.created_at for r in rows)


def test_offsets_json_reads_a_range_and_a_data_directory_reads_the_same(
    spark: SparkSession, meta_server: str, subject: str, data_dir: str
) -> None:
    ids = send_messages(meta_server, subject, 40)
    offsets = {
        "startingOffsets": json.dumps({subject: {"broker-1": 10}}),
        "endingOffsets": json.dumps({subject: {"broker-1": 25}}),
    }
    pattern = subject.replace(".", "\\.")
    remote = spark.read.format("qmq").option("meta_server", meta_server).option("subscribe", subject)
    offline = spark.read.format("qmq").option("path", data_dir).option("subscribePattern", pattern)
    got_remote = [r.message_id for r in remote.options(**offsets).load().orderBy("sequence").collect()]
    got_offline = [r.message_id for r in offline.options(**offsets).load().orderBy("sequence").collect()]
    assert got_remote == ids[10:25]
    assert got_offline == ids[10:25]
    whole = spark.read.format("qmq").option("path", data_dir).option("subscribePattern", pattern).load()
    assert whole.count() == 40


def test_a_subject_nobody_sent_to_reads_as_an_empty_table(spark: SparkSession, meta_server: str, subject: str) -> None:
    df = spark.read.format("qmq").option("meta_server", meta_server).option("subscribe", subject).load()
    assert df.count() == 0
