"""Figures of qmq on Spark: batch read through the data source, archive export, query by id.

    .venv/bin/python bench/spark_bench.py [--messages 1000000] [--archive-rows 10000000] [--only read,archive,query]

- read: N messages of 100-byte bodies are sent to one subject of a `qmq standalone` (port 0,
  periodic flush), then read with `spark.read.format("qmq")` through the meta server and
  from the data directory, into Spark's `noop` sink (every row read and converted, nothing
  written). Figure: messages per second of the read, with the session already up.
- archive: the same messages archived by `run_archive` (the job behind `qmq archive`).
- query: a synthetic archive of M rows (same schema and partitioning: 10 subjects over 30
  days, 100-byte bodies, ids made like the SDK's) written with Spark, then `find_by_id`
  (the job behind `qmq query --message-id`) for a few ids. Figure: seconds per lookup once
  the session is up.

Sessions are `local[*]`; the machine's cores are shared, so run it on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from qmq.aio import Producer
from qmq.common.errors import BufferFullError
from qmq.spark.archive import run_archive
from qmq.spark.query import find_by_id
from qmq.spark.session import build_session
from qmq.testing import running_standalone

SUBJECT = "bench.spark"
BODY = b"x" * 100
_SEND_WINDOW = 50_000


async def _produce(meta_server: str, n: int) -> float:
    t0 = time.perf_counter()
    async with Producer(app_code="spark-bench", meta_server=meta_server) as producer:
        pending: list[asyncio.Future[None]] = []
        for _ in range(n):
            m = producer.generate_message(SUBJECT)
            m.body = BODY
            while True:
                try:
                    pending.append(producer.send_nowait(m))
                    break
                except BufferFullError:
                    await asyncio.gather(*pending)
                    pending.clear()
            if len(pending) >= _SEND_WINDOW:
                await asyncio.gather(*pending)
                pending.clear()
        await asyncio.gather(*pending)
    return n / (time.perf_counter() - t0)


def _timed_read(spark: SparkSession, options: dict[str, str]) -> float:
    """Seconds to read the subject whole (planning included) into the noop sink."""
    t0 = time.perf_counter()
    df = spark.read.format("qmq").options(**options).option("subscribe", SUBJECT).load()
    df.write.format("noop").mode("overwrite").save()
    return time.perf_counter() - t0


def bench_read_and_archive(spark: SparkSession, n: int, work: Path, do_read: bool, do_archive: bool) -> None:
    data_dir = work / "qmq-data"
    with running_standalone(data_dir, {"broker": {"flush": "periodic"}}) as proc:
        rate = asyncio.run(_produce(proc.meta_server, n))
        print(f"sent {n:,} messages of {len(BODY)} B at {rate:,.0f}/s (periodic flush)")
        if do_read:
            for label, options in (
                ("meta server", {"meta_server": proc.meta_server}),
                ("data directory", {"path": str(data_dir)}),
            ):
                for attempt in (1, 2, 3):
                    seconds = _timed_read(spark, options)
                    print(f"read via {label} (run {attempt}): {n:,} messages in {seconds:.2f} s = {n / seconds:,.0f}/s")
        if do_archive:
            for label, source in (
                ("meta server", {"meta_server": proc.meta_server}),
                ("data directory", {"path": str(data_dir)}),
            ):
                target = work / f"archive-{label.replace(' ', '-')}"
                result = run_archive(spark, source, target)
                count = spark.read.parquet(str(target)).where(F.col("subject") == SUBJECT).count()
                assert count == n, f"archived {count} of {n}"
                print(
                    f"archive via {label}: {result.messages:,} messages in {result.seconds:.2f} s = "
                    f"{result.messages / result.seconds:,.0f}/s"
                )


def make_archive(spark: SparkSession, rows: int, target: Path) -> None:
    """A synthetic archive with the data source's schema, partitioned by subject and date."""
    start_s = 1_763_683_200  # 2025-11-21T00:00:00Z
    span_s = 30 * 86_400
    df = (
        spark.range(rows, numPartitions=max(8, rows // 1_000_000))
        .withColumn(
            "created_ms", F.lit(start_s * 1000) + (F.col("id") * F.lit(span_s * 1000) / F.lit(rows)).cast("long")
        )
        .withColumn("created_at", F.timestamp_millis("created_ms"))
        .withColumn("subject", F.concat(F.lit("order.s"), (F.col("id") % 10).cast("string")))
        .withColumn("broker_group", F.lit("broker-1"))
        .withColumn("sequence", (F.col("id") / 10).cast("long"))
        .withColumn(
            "message_id",
            F.concat(
                F.date_format("created_at", "yyMMddHHmmssSSS"), F.lit(".a1b2c3.4242."), F.col("id").cast("string")
            ),
        )
        .withColumn("tags", F.array().cast("array<string>"))
        .withColumn("properties", F.create_map().cast("map<string,string>"))
        .withColumn("body", F.lit(BODY))
        .withColumn("stored_at", F.col("created_at"))
        .withColumn("date", F.to_date("created_at"))
        .drop("id", "created_ms")
    )
    df.write.mode("overwrite").partitionBy("subject", "date").parquet(str(target))


def bench_query(spark: SparkSession, rows: int, work: Path, keep: Path | None) -> None:
    target = keep or work / "synthetic-archive"
    if not (target / "_SUCCESS").exists():
        t0 = time.perf_counter()
        make_archive(spark, rows, target)
        print(f"made a synthetic archive of {rows:,} rows in {time.perf_counter() - t0:.1f} s at {target}")
    sample = spark.read.parquet(str(target)).select("message_id").sample(fraction=min(1.0, 50 / rows), seed=7).limit(5)
    ids = [r.message_id for r in sample.collect()]
    times = []
    for message_id in ids:
        t0 = time.perf_counter()
        found = find_by_id(spark, target, message_id)
        seconds = time.perf_counter() - t0
        assert len(found) == 1, f"{message_id}: found {len(found)}"
        times.append(seconds)
        print(f"query --message-id {message_id}: {seconds:.2f} s")
    print(f"query by id in {rows:,} rows: median {statistics.median(times):.2f} s, max {max(times):.2f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=1_000_000)
    parser.add_argument("--archive-rows", type=int, default=10_000_000)
    parser.add_argument("--only", default="read,archive,query")
    parser.add_argument("--keep-archive", type=Path, help="make (or reuse) the synthetic archive here")
    parser.add_argument("--master", default="local[*]")
    args = parser.parse_args()
    parts = set(args.only.split(","))
    work = Path(tempfile.mkdtemp(prefix="qmq-spark-bench-"))
    print(f"python {sys.version.split()[0]}, {os.cpu_count()} cores, master {args.master}")
    t0 = time.perf_counter()
    spark = build_session(args.master, "qmq spark bench", {"spark.driver.memory": "4g"})
    print(f"session up in {time.perf_counter() - t0:.1f} s")
    try:
        if parts & {"read", "archive"}:
            bench_read_and_archive(spark, args.messages, work, "read" in parts, "archive" in parts)
        if "query" in parts:
            bench_query(spark, args.archive_rows, work, args.keep_archive)
    finally:
        spark.stop()
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
