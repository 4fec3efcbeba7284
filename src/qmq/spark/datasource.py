"""The ``qmq`` Python data source of Spark: stored messages as a table or a stream, and
DataFrames into messages (``writer.py``).

Batch reads plan on the driver (``fetch_bounds``, then ``plan`` into slices) and read each
slice in an executor (``read_task``). A stream's offsets are JSON per (broker group,
subject) sequence, kept by Spark in the query's checkpoint — the checkpoint is the
consumer's state; no consumer group is involved, and ``commit`` has nothing to do. The
driver-side stream reader outlives micro-batches, but its ``read`` runs on a pickled copy:
every slice carries all it needs.

A subject that appears while a stream runs joins at its first kept sequence: the micro-batch
that finds it only records that position, the next ones read from it, so a replayed batch
plans exactly the same slices.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any

import pyarrow as pa
from pyspark.sql.datasource import DataSource, DataSourceReader, DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadAllAvailable, ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import StructType

from qmq.spark.offsets import Positions, SourceOptions, from_json, limit, parse_options, plan, resolve, to_json
from qmq.spark.records import SPARK_SCHEMA_DDL
from qmq.spark.sources import ReadTask, SourceState, fetch_bounds, read_task
from qmq.spark.writer import QmqStreamWriter, QmqWriter, parse_write_options


def _tasks(options: SourceOptions, start: Positions, end: Positions, addresses: dict[str, str]) -> list[InputPartition]:
    return [
        InputPartition(
            ReadTask(
                meta_server=options.meta_server,
                path=options.path,
                broker_group=s.broker_group,
                address=addresses.get(s.broker_group, ""),
                subject=s.subject,
                start=s.start,
                end=s.end,
                fail_on_data_loss=options.fail_on_data_loss,
                access=options.access,
            )
        )
        for s in plan(start, end, options.records_per_partition, options.min_partitions)
    ]


class QmqDataSource(DataSource):
    """``spark.read.format("qmq")`` / ``readStream`` / ``write`` / ``writeStream``; options in docs/spark.md."""

    @classmethod
    def name(cls) -> str:
        return "qmq"

    def schema(self) -> str:
        return SPARK_SCHEMA_DDL

    def reader(self, schema: StructType) -> DataSourceReader:
        return QmqBatchReader(parse_options(self.options, streaming=False))

    def streamReader(self, schema: StructType) -> DataSourceStreamReader:
        return QmqStreamReader(parse_options(self.options, streaming=True))

    def writer(self, schema: StructType, overwrite: bool) -> QmqWriter:
        return QmqWriter(parse_write_options(self.options, schema))

    def streamWriter(self, schema: StructType, overwrite: bool) -> QmqStreamWriter:
        return QmqStreamWriter(parse_write_options(self.options, schema))


class QmqBatchReader(DataSourceReader):
    """A batch read from ``startingOffsets`` to ``endingOffsets``, both resolved once, when planned."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        state = fetch_bounds(options)
        start = resolve(options.starting, state.bounds, "earliest")
        end = resolve(options.ending, state.bounds, "latest")
        # an ending offset past what is stored would wait forever in a batch read: stop at the end
        end = {p: min(seq, state.bounds[p][1]) for p, seq in end.items()}
        self.start = start
        self.end = end
        self._partitions = _tasks(options, start, end, state.addresses)

    def partitions(self) -> Sequence[InputPartition]:
        # Spark reads an empty list of partitions as one partition of value None
        return self._partitions or [InputPartition(None)]

    def read(self, partition: InputPartition | None) -> Iterator[pa.RecordBatch]:
        task: ReadTask | None = partition.value if partition is not None else None
        return read_task(task) if task is not None else iter(())


class QmqStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """A stream of the selected subjects; offsets in the checkpoint are its only state."""

    def __init__(self, options: SourceOptions) -> None:
        self.options = options
        self._addresses: dict[str, str] = {}
        self._target: Positions | None = None  # trigger(availableNow=True): where to stop

    def _fetch(self) -> SourceState:
        state = fetch_bounds(self.options)
        self._addresses.update(state.addresses)
        return state

    def initialOffset(self) -> dict[str, Any]:
        state = self._fetch()
        return to_json(resolve(self.options.starting, state.bounds, "earliest"))

    def getDefaultReadLimit(self) -> ReadLimit:
        n = self.options.max_offsets_per_trigger
        return ReadAllAvailable() if n is None else ReadMaxRows(n)

    def prepareForTriggerAvailableNow(self) -> None:
        self._target = {p: end for p, (_first, end) in self._fetch().bounds.items()}

    def latestOffset(self, start: dict[str, Any], limit_: ReadLimit) -> dict[str, Any]:
        begin = from_json(start)
        state = self._fetch()
        latest: Positions = {}
        for pair, (first, end) in state.bounds.items():
            if pair not in begin:
                # new since the last batch: this batch records where it starts, the next reads it
                begin[pair] = first
                latest[pair] = first
                continue
            latest[pair] = end
            if self._target is not None:
                latest[pair] = min(end, self._target.get(pair, begin[pair]))
        max_rows = limit_.max_rows if isinstance(limit_, ReadMaxRows) else None
        return to_json(limit(begin, latest, max_rows))

    def partitions(self, start: dict[str, Any], end: dict[str, Any]) -> Sequence[InputPartition]:
        begin, stop = from_json(start), from_json(end)
        if begin == stop:
            return []
        groups = {g for g, _s in stop}
        if self.options.meta_server is not None and not groups <= set(self._addresses):
            self._fetch()  # a replayed batch after a restart: addresses not looked up yet
        return _tasks(self.options, begin, stop, self._addresses)

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        task: ReadTask = partition.value
        return read_task(task)

    def commit(self, end: dict[str, Any]) -> None:
        """Nothing to do: the checkpoint's offset log is the consumer state."""
