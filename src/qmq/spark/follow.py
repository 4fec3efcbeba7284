"""The continuous archive (``qmq archive --follow``): a Structured Streaming query over the
``qmq`` source whose sink commits the archive's own bookkeeping with each micro-batch.

The archive's manifests (``ledger.py``), not the stream's checkpoint, say what is archived:

- the stream starts at the newest manifest's offsets (subjects it does not name: earliest);
  its checkpoint is a workspace of this run only, dropped when the run ends;
- each micro-batch keeps only the rows past the newest manifest's offset of their (broker
  group, subject) — rows a batch ``qmq archive`` run or an earlier micro-batch committed
  meanwhile are left out — writes them into a workspace and commits a manifest whose
  offsets move to the last sequence written + 1. A micro-batch that another writer beat
  to the manifest number is done again on the new state.

So a row is archived once whatever stops: a run killed before its commit leaves a workspace
that the next load removes, one killed after it leaves files the next load moves into place.
Every ``LAG_EVERY_S`` a micro-batch also records the consumer groups' lag and the new dead
letters, as a batch run does. ``stop`` (set from a signal handler) makes the run finish the
micro-batch under way, stop the query and return.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from qmq.common.errors import ConfigError, QmqError
from qmq.spark.archive import COMMIT_TRIES, stage_lag_and_dead, with_date
from qmq.spark.ledger import ArchiveState, ConflictError, Ledger, Workspace
from qmq.spark.offsets import Pair, Positions, parse_options, to_json
from qmq.spark.sources import Bounds, fetch_bounds

log = logging.getLogger(__name__)

# Consumer groups' lag and dead letters are recorded at most this often (and at the start).
LAG_EVERY_S = 60.0
MAX_PER_BATCH_DEFAULT = 1_000_000
TRIGGER_INTERVAL_DEFAULT_S = 10.0
# How often the driver looks whether it was told to stop, or the query ended.
_STOP_POLL_S = 0.25


class FollowError(QmqError):
    """The streaming query failed (its error is in the text)."""


@dataclass(frozen=True)
class BatchReport:
    """One micro-batch, for the progress line."""

    batch: int  # Spark's micro-batch id (counted from 0 in each run)
    manifest: int | None  # the manifest committed, None when there was nothing to commit
    messages: int
    per_subject: dict[str, int]
    lag: int  # messages stored on the brokers and not archived yet, after this commit
    groups: int
    dead_letters: int
    seconds: float

    @property
    def subjects(self) -> int:
        return len(self.per_subject)


@dataclass
class FollowResult:
    batches: int = 0
    messages: int = 0
    per_subject: dict[str, int] = field(default_factory=dict)


def parse_interval(text: str) -> float:
    """``10s``, ``500ms``, ``2m`` or a number of seconds → seconds; ConfigError otherwise."""
    raw = text.strip().lower()
    for suffix, unit in (("ms", 0.001), ("s", 1.0), ("m", 60.0), ("h", 3600.0)):
        if raw.endswith(suffix):
            number, scale = raw[: -len(suffix)].strip(), unit
            break
    else:
        number, scale = raw, 1.0
    try:
        value = float(number) * scale
    except ValueError:
        raise ConfigError(f"trigger interval {text!r} is not a duration; write e.g. 10s, 500ms or 2m") from None
    if not 0 < value <= 86_400:
        raise ConfigError(f"trigger interval {text!r} must be more than 0 and at most a day")
    return value


def lag_of(bounds: Bounds, archived: Positions) -> int:
    """Messages stored (and still kept) on the brokers past what the archive holds."""
    return sum(max(0, end - max(first, archived.get(pair, 0))) for pair, (first, end) in bounds.items())


class Follower:
    """Runs the continuous archive of ``source`` into ``to`` until ``stop`` is set."""

    def __init__(
        self,
        spark: SparkSession,
        source: dict[str, str],
        to: Path,
        *,
        trigger_interval_s: float = TRIGGER_INTERVAL_DEFAULT_S,
        max_per_batch: int = MAX_PER_BATCH_DEFAULT,
        on_batch: Callable[[BatchReport], None] | None = None,
        stop: threading.Event | None = None,
    ) -> None:
        if max_per_batch < 1:
            raise ConfigError(f"--max-per-batch {max_per_batch} must be at least 1")
        self.spark = spark
        self.source = source
        self.to = to
        self.trigger_interval_s = trigger_interval_s
        self.max_per_batch = max_per_batch
        self.on_batch = on_batch
        self.options = parse_options({**source, "subscribePattern": ".*"}, streaming=False)
        self.ledger = Ledger(to)
        self.stop = stop if stop is not None else threading.Event()
        # held while a micro-batch writes and commits: stopping waits for it
        self._batch_lock = threading.Lock()
        self._lag_due = 0.0
        self.result = FollowResult()

    def run(self) -> FollowResult:
        """Archive micro-batch after micro-batch until ``stop`` is set (at once if it is)."""
        if self.stop.is_set():
            return self.result
        self.to.mkdir(parents=True, exist_ok=True)
        state = self.ledger.load()
        starting = json.dumps(to_json(state.offsets)) if state.offsets else "earliest"
        stream = (
            self.spark.readStream.format("qmq")
            .options(**self.source)
            .option("subscribePattern", ".*")
            .option("startingOffsets", starting)
            .option("failOnDataLoss", "false")
            .option("maxOffsetsPerTrigger", str(self.max_per_batch))
            .load()
        )
        with self.ledger.workspace() as run_ws:
            query = (
                stream.writeStream.foreachBatch(self._sink)
                .option("checkpointLocation", str(run_ws.path / "checkpoint"))
                .trigger(processingTime=f"{round(self.trigger_interval_s * 1000)} milliseconds")
                .queryName(f"qmq-archive-{run_ws.token}")
                .start()
            )
            try:
                while not self.stop.wait(_STOP_POLL_S):  # bounded by stop or the query's end
                    if not query.isActive:
                        break
            finally:
                # a micro-batch that starts from here returns at once; the one under way
                # commits first. The query stops outside the lock: stopping waits for the
                # stream's thread, which may be calling the sink.
                self.stop.set()
                with self._batch_lock:
                    pass
                query.stop()
            error = query.exception()
            if error is not None:
                raise FollowError(
                    f"the continuous archive into {self.to} stopped on an error: {error}; "
                    "what was committed stays, and a new run goes on from there"
                )
        return self.result

    # -- the sink, on the driver, once per micro-batch -----------------------------------------

    def _sink(self, df: DataFrame, batch_id: int) -> None:
        with self._batch_lock:
            if self.stop.is_set():
                return  # stopping: nothing of it is committed, the next run reads it again
            t0 = time.monotonic()
            for attempt in range(1, COMMIT_TRIES + 1):
                try:
                    report = self._archive(df, batch_id, t0)
                    break
                except ConflictError:
                    if attempt == COMMIT_TRIES:
                        raise
                    log.info("micro-batch %d: another archive run committed first; doing it again", batch_id)
            self.result.batches += 1
            self.result.messages += report.messages
            for subject, n in report.per_subject.items():
                self.result.per_subject[subject] = self.result.per_subject.get(subject, 0) + n
            if self.on_batch is not None:
                self.on_batch(report)

    def _archive(self, df: DataFrame, batch_id: int, t0: float) -> BatchReport:
        state = self.ledger.load()
        with self.ledger.workspace() as ws:
            fresh = self._not_archived(df, state)
            with_date(fresh).write.mode("append").partitionBy("subject", "date").parquet(str(ws.path))
            written = self._written(ws)
            after = ArchiveState(dict(state.offsets), dict(state.dead), state.number)
            for pair, (last, _n) in written.items():
                after.offsets[pair] = max(after.offsets.get(pair, 0), last + 1)
            groups = dead = 0
            bounds: Bounds | None = None
            if time.monotonic() >= self._lag_due:
                bounds = fetch_bounds(self.options).bounds
                groups, dead = stage_lag_and_dead(self.options, bounds, after, ws)
                self._lag_due = time.monotonic() + LAG_EVERY_S
            messages = sum(n for _last, n in written.values())
            number: int | None = None
            if written or groups or dead:
                info = {"writer": "follow", "messages": messages, "micro_batch": batch_id}
                number = self.ledger.commit(state, after, ws, info)
        if bounds is None or written:
            bounds = fetch_bounds(self.options).bounds
        per_subject: dict[str, int] = {}
        for (_g, subject), (_last, n) in written.items():
            per_subject[subject] = per_subject.get(subject, 0) + n
        return BatchReport(
            batch=batch_id,
            manifest=number,
            messages=messages,
            per_subject=per_subject,
            lag=lag_of(bounds, after.offsets),
            groups=groups,
            dead_letters=dead,
            seconds=round(time.monotonic() - t0, 3),
        )

    def _not_archived(self, df: DataFrame, state: ArchiveState) -> DataFrame:
        """The rows of ``df`` past the archive's offset of their (broker group, subject)."""
        if not state.offsets:
            return df
        done = self.spark.createDataFrame(
            [(g, s, seq) for (g, s), seq in sorted(state.offsets.items())],
            "broker_group string, subject string, archived_to long",
        )
        joined = df.join(F.broadcast(done), ["broker_group", "subject"], "left")
        keep = F.col("archived_to").isNull() | (F.col("sequence") >= F.col("archived_to"))
        return joined.where(keep).select(*df.columns)

    def _written(self, ws: Workspace) -> dict[Pair, tuple[int, int]]:
        """Per pair, the last sequence written into ``ws`` and how many rows."""
        if not Ledger.staged_files(ws):
            return {}
        counts = (
            self.spark.read.parquet(str(ws.path))
            .groupBy("broker_group", "subject")
            .agg(F.max("sequence").alias("last"), F.count(F.lit(1)).alias("n"))
            .collect()
        )
        return {(str(r["broker_group"]), str(r["subject"])): (int(r["last"]), int(r["n"])) for r in counts}
