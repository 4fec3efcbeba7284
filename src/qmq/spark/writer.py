"""DataFrames into messages: the write side of the ``qmq`` data source (batch and stream).

Rows need a ``body`` (binary or string); ``subject`` (else the ``subject`` option),
``message_id``, ``tags`` (array of strings) and ``properties`` (map of strings to strings,
each value sent as a str property) are optional. Each write task sends its rows with the
asyncio producer on a private event loop and returns once every message is stored.

A row without a message id gets a deterministic one, so a task that Spark retries sends the
same ids again and the broker's duplicate window (keyed on id, subject and attempt) drops the
repeats:

- batch writes: ``<yyMMddHHmmssSSS>.<token>.<partition>.<row>`` — the time and a random token
  are fixed when the write is planned, on the driver, and every attempt of a task gets the
  same planned writer. The message's creation time is that time, as for ids the SDK makes.
- stream writes: ``q<query>.<batch>.<partition>.<row>`` — ``<query>`` is taken from the
  streaming query's id (kept in its checkpoint), so a micro-batch replayed after a restart
  resends the same ids too (when the source replays the same rows, as ``qmq`` does).

Retried tasks are caught as long as the repeat arrives within the broker's duplicate window
(10 minutes by default).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import time
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

import pyarrow as pa
from pyspark import TaskContext
from pyspark.sql.datasource import DataSourceArrowWriter, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import BinaryType, StringType, StructType

from qmq.client.message import check_message_id, subject_bytes
from qmq.client.producer import Producer
from qmq.common.errors import ConfigError, MessageTooLargeError, SendError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.message import check_property, check_tag, encode_message, encode_properties, encode_tags
from qmq.spark.access import Access, access_of

_KNOWN_COLUMNS = ("subject", "body", "message_id", "tags", "properties")
# Messages a write task has in the producer at once; it waits for the oldest beyond this.
_IN_FLIGHT_MAX = 20_000
_SEND_TIMEOUT_MS = 60_000


@dataclass(frozen=True, slots=True)
class WriteOptions:
    meta_server: str
    subject: str | None
    app_code: str
    columns: tuple[str, ...]
    access: Access  # the secret and CA of the producer's connections


@dataclass(frozen=True, slots=True)
class WriteResult(WriterCommitMessage):
    """What one write task did: messages handed over, and how many the broker already had."""

    partition: int
    messages: int
    duplicates: int


def parse_write_options(options: Mapping[str, str], schema: StructType) -> WriteOptions:
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    meta_server = opts.get("meta_server") or opts.get("metaserver")
    if not meta_server:
        raise ConfigError("writing to qmq needs option meta_server: the URL printed by `qmq ready`")
    names = tuple(f.name for f in schema.fields)
    if "body" not in names:
        raise ConfigError(
            f"the DataFrame has no body column (it has {', '.join(names) or 'none'}); "
            "select or rename one: df.selectExpr('CAST(value AS BINARY) AS body')"
        )
    body_type = schema["body"].dataType
    if not isinstance(body_type, BinaryType | StringType):
        raise ConfigError(f"column body is {body_type.simpleString()}; make it binary or string")
    subject = opts.get("subject")
    if subject is None and "subject" not in names:
        raise ConfigError("give option subject, or a subject column, to say where each row goes")
    if subject is not None:
        subject_bytes(subject)  # fails here, on the driver, naming the subject
    access = access_of(opts)
    return WriteOptions(meta_server, subject, access.app_code, names, access)


def batch_id_prefix(now_ms: int | None = None) -> tuple[str, int]:
    """``<yyMMddHHmmssSSS>.<token>`` of a batch write, and its time (epoch ms)."""
    ms = time.time_ns() // 1_000_000 if now_ms is None else now_ms
    stamp = time.strftime("%y%m%d%H%M%S", time.gmtime(ms // 1000)) + f"{ms % 1000:03d}"
    return f"{stamp}.{secrets.token_hex(3)}", ms


def stream_id_prefix(query_id: str | None, fallback: str) -> str:
    """``q<query>`` of a stream write: a short hash of the streaming query's id."""
    if not query_id:
        return fallback
    return "q" + hashlib.sha256(query_id.encode("utf-8")).hexdigest()[:12]


def encode_rows(
    batch: pa.RecordBatch, options: WriteOptions, id_prefix: str, row_base: int, created_ms: int | None
) -> list[tuple[str, bytes, str]]:
    """``(subject, encoded message, message id)`` for each row of ``batch``."""
    n = batch.num_rows
    cols = {name: batch.column(name).to_pylist() for name in _KNOWN_COLUMNS if name in batch.schema.names}
    bodies = cols["body"]
    subjects = cols.get("subject") or [None] * n
    ids = cols.get("message_id") or [None] * n
    tag_lists = cols.get("tags") or [None] * n
    prop_lists = cols.get("properties") or [None] * n
    now_ms = time.time_ns() // 1_000_000
    limits = DEFAULT_LIMITS
    out: list[tuple[str, bytes, str]] = []
    for i in range(n):
        row = row_base + i
        subject = subjects[i] or options.subject
        if subject is None:
            raise ConfigError(f"row {row} of partition {id_prefix} has no subject and no subject option is set")
        message_id = ids[i]
        if message_id is None:
            message_id = f"{id_prefix}.{row}"
            created = now_ms if created_ms is None else created_ms
        else:
            check_message_id(message_id)
            created = now_ms
        body = bodies[i]
        if body is None:
            body = b""
        elif isinstance(body, str):
            body = body.encode("utf-8")
        tags = tag_lists[i] or []
        for tag in tags:
            check_tag(tag, limits)
        props: dict[str, str] = {}
        raw_props = prop_lists[i]
        if raw_props:
            for key, value in raw_props.items() if isinstance(raw_props, dict) else raw_props:
                if value is None:
                    continue
                check_property(key, value, limits)
                props[key] = value
        encoded = encode_message(
            subject_bytes(subject),
            message_id.encode("utf-8"),
            encode_tags(tags) if tags else b"",
            len(tags),
            encode_properties(props) if props else b"",
            body,
            created,
        )
        if len(encoded) > limits.message_bytes_max:
            raise MessageTooLargeError(
                f"row {row} (message {message_id}) encodes to {len(encoded)} bytes, over message_bytes_max "
                f"{limits.message_bytes_max}; make its body smaller"
            )
        out.append((subject, encoded, message_id))
    return out


async def _send(
    batches: Iterator[pa.RecordBatch], options: WriteOptions, id_prefix: str, created_ms: int | None, partition: int
) -> WriteResult:
    producer = Producer(
        app_code=options.app_code,
        meta_server=options.meta_server,
        send_timeout_ms=_SEND_TIMEOUT_MS,
        secret=options.access.secret,
        ssl=options.access.tls(options.meta_server),
    )
    await producer.start()
    loop = asyncio.get_running_loop()
    pending: deque[asyncio.Future[None]] = deque()
    rows = 0
    try:
        for batch in batches:
            for subject, encoded, message_id in encode_rows(batch, options, id_prefix, rows, created_ms):
                while pending and (len(pending) >= _IN_FLIGHT_MAX or not producer.has_room(len(encoded))):
                    await pending.popleft()
                fut: asyncio.Future[None] = loop.create_future()
                producer.enqueue_encoded(subject, encoded, message_id, fut)
                pending.append(fut)
            rows += batch.num_rows
            await asyncio.sleep(0)  # let the sender take what this batch buffered
        while pending:  # bounded: each turn removes one
            await pending.popleft()
    finally:
        # also on failure: what was handed over is sent (a retry's repeats are then dropped as duplicates)
        await producer.close()
        for fut in pending:
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved: the first failure was already raised
    if producer.stats.messages_failed:
        raise SendError(f"{producer.stats.messages_failed} messages of write task {partition} were not stored")
    return WriteResult(partition, rows, producer.stats.duplicates)


def _run(
    batches: Iterator[pa.RecordBatch], options: WriteOptions, id_prefix: str, created_ms: int | None
) -> WriteResult:
    ctx = TaskContext.get()
    partition = ctx.partitionId() if ctx is not None else 0
    return asyncio.run(_send(batches, options, f"{id_prefix}.{partition}", created_ms, partition))


class QmqWriter(DataSourceArrowWriter):
    """A batch write; the id prefix is fixed here, on the driver, for every task attempt."""

    def __init__(self, options: WriteOptions) -> None:
        self.options = options
        self.id_prefix, self.created_ms = batch_id_prefix()

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteResult:
        return _run(iterator, self.options, self.id_prefix, self.created_ms)


class QmqStreamWriter(DataSourceStreamArrowWriter):
    """A stream write: ids from the query id, the micro-batch id, the partition and the row."""

    def __init__(self, options: WriteOptions) -> None:
        self.options = options
        self.fallback_prefix = "s" + secrets.token_hex(6)

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriteResult:
        ctx = TaskContext.get()
        query_id = ctx.getLocalProperty("sql.streaming.queryId") if ctx is not None else None
        batch_id = ctx.getLocalProperty("streaming.sql.batchId") if ctx is not None else None
        prefix = f"{stream_id_prefix(query_id, self.fallback_prefix)}.{batch_id or 0}"
        return _run(iterator, self.options, prefix, None)
