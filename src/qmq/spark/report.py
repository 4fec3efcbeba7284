"""The report job (``qmq report``): per subject and day, from an archive.

=================  ==============================================================
messages, bytes    messages created that day and the bytes of their bodies
retries            messages on the subject's retry subjects (``%RETRY%<subject>%*``)
                   created that day: failed deliveries, of any consumer group
retry_rate         retries / messages
dead_letters       messages that went to the dead letters that day (any group)
dead_letter_rate   dead_letters / messages
consumer_lag       messages stored and not yet acknowledged, summed over the
                   subject's consumer groups, at the day's last archive run
                   (null on days without a run)
=================  ==============================================================

Written as Parquet (``<archive>/_report`` unless told otherwise), replaced whole each run.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession, Window
from pyspark.sql import functions as F

from qmq.common.errors import ConfigError
from qmq.common.naming import RETRY_PREFIX
from qmq.spark.archive import DEAD_DIR, GROUPS_DIR

REPORT_DIR = "_report"
COLUMNS = (
    "subject",
    "date",
    "messages",
    "bytes",
    "retries",
    "retry_rate",
    "dead_letters",
    "dead_letter_rate",
    "consumer_lag",
)


def _optional(spark: SparkSession, path: Path) -> DataFrame | None:
    return spark.read.parquet(str(path)) if path.is_dir() and any(path.glob("*.parquet")) else None


def build_report(spark: SparkSession, archive: Path) -> DataFrame:
    if not archive.is_dir() or not any(archive.glob("subject=*")):
        raise ConfigError(f"{str(archive)!r} holds no archived messages; run `qmq archive --to {archive}` first")
    messages = spark.read.parquet(str(archive))
    is_retry = F.col("subject").startswith(RETRY_PREFIX)
    # %RETRY%<subject>%<group>: the subject sits between the prefix and the last '%'
    base_subject = F.regexp_extract(F.col("subject"), r"^%RETRY%(.*)%[^%]*$", 1)
    daily = (
        messages.where(~is_retry)
        .groupBy("subject", "date")
        .agg(F.count(F.lit(1)).alias("messages"), F.sum(F.length("body")).alias("bytes"))
    )
    retries = (
        messages.where(is_retry)
        .select(base_subject.alias("subject"), "date")
        .groupBy("subject", "date")
        .agg(F.count(F.lit(1)).alias("retries"))
    )
    report = daily.join(retries, ["subject", "date"], "full_outer")
    dead = _optional(spark, archive / DEAD_DIR)
    if dead is not None:
        dead_daily = (
            dead.dropDuplicates(["broker_group", "subject", "consumer_group", "letter"])
            .select("subject", F.to_date("dead_at").alias("date"))
            .groupBy("subject", "date")
            .agg(F.count(F.lit(1)).alias("dead_letters"))
        )
        report = report.join(dead_daily, ["subject", "date"], "full_outer")
    else:
        report = report.withColumn("dead_letters", F.lit(None).cast("long"))
    groups = _optional(spark, archive / GROUPS_DIR)
    if groups is not None:
        day = F.to_date("run_at")
        last = Window.partitionBy("subject", "date").orderBy(F.col("run_at").desc())
        lag = (
            groups.where(~F.col("subject").startswith("%"))
            .withColumn("date", day)
            .withColumn("lag", F.col("backlog") + F.col("unacked"))
            .groupBy("subject", "date", "run_at")
            .agg(F.sum("lag").alias("consumer_lag"))
            .withColumn("rank", F.row_number().over(last))
            .where(F.col("rank") == 1)
            .select("subject", "date", "consumer_lag")
        )
        report = report.join(lag, ["subject", "date"], "left")
    else:
        report = report.withColumn("consumer_lag", F.lit(None).cast("long"))
    filled = report.fillna(0, ["messages", "bytes", "retries", "dead_letters"])
    rate = F.when(F.col("messages") > 0, F.col("retries") / F.col("messages"))
    dead_rate = F.when(F.col("messages") > 0, F.col("dead_letters") / F.col("messages"))
    return (
        filled.withColumn("retry_rate", rate)
        .withColumn("dead_letter_rate", dead_rate)
        .select(*COLUMNS)
        .orderBy("subject", "date")
    )


def run_report(spark: SparkSession, archive: Path, out: Path | None = None) -> tuple[Path, list[dict[str, Any]]]:
    """Build the report, write it as Parquet and return where, with its rows."""
    report = build_report(spark, archive).cache()
    target = out or archive / REPORT_DIR
    report.coalesce(1).write.mode("overwrite").parquet(str(target))
    rows = [r.asDict() for r in report.collect()]
    report.unpersist()
    return target, rows
