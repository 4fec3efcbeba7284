"""The trace job (``qmq trace``): the life of one message, as QMQ's backup server tells it.

- **stored**: every subject that holds the message id — its own subject and, after a failed
  delivery, the group's retry subject ``%RETRY%<subject>%<group>`` with a higher attempt and
  the handler's error in the ``qmq.error`` property. Found with a Spark job over the archive
  (by id, see ``query.py``) and over the broker's files or the brokers (every subject, from
  the first sequence stored at or after the id's time).
- **pulled / acked**: from the broker's action log (each PULL names the consumer and the
  pull-log offsets it got; each ACK the pull-log ranges that consumer finished), and for
  what is older than the oldest kept action-log segment, from the checkpoint's progress.
  This needs the broker's files (``data_dir``); through a meta server the brokers do not
  tell who consumed what.
- **dead-lettered**: the dead letters of the message id, and whether they were resent or
  purged since.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession
from pyspark.sql import functions as F

from qmq.common.errors import ConfigError
from qmq.common.naming import parse_internal_subject
from qmq.protocol.message import decode_message, decode_properties, delivery_attempt
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.spark.access import environment_options
from qmq.spark.offsets import DEFAULT_BROKER_GROUP, to_json
from qmq.spark.query import ISO_TIMESTAMP, find_by_id, id_date
from qmq.spark.records import property_text
from qmq.store import action_log as act
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.reader import StoreReader

# A producer's clock may run behind the broker's; records stored this long before the id's
# time are still searched.
_CLOCK_SLACK = timedelta(days=1)


@dataclass
class Stored:
    subject: str
    broker_group: str
    sequence: int
    stored_at: str | None
    attempt: int | None = None  # 0 first delivery; n: the n-th retry
    error: str | None = None
    found_in: str = ""


@dataclass
class Delivery:
    subject: str
    consumer_group: str
    consumer_id: str | None
    pull_log_offset: int | None
    acked: bool
    known_from: str  # "action log" or "checkpoint"


@dataclass
class Dead:
    consumer_group: str
    letter: int
    attempts: int
    error: str | None
    dead_at: str
    removed: bool


@dataclass
class Trace:
    message_id: str
    stored: list[Stored] = field(default_factory=list)
    deliveries: list[Delivery] = field(default_factory=list)
    dead: list[Dead] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=False)


def _iso(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def trace(
    spark: SparkSession,
    message_id: str,
    data_dir: str | None = None,
    archive: Path | None = None,
    meta_server: str | None = None,
    broker_group: str = DEFAULT_BROKER_GROUP,
) -> Trace:
    if data_dir is None and archive is None and meta_server is None:
        raise ConfigError("give --data-dir (the broker's files: full history), --archive, or --meta-server")
    out = Trace(message_id)
    seen: set[tuple[str, str, int]] = set()
    if data_dir is not None:
        _trace_files(spark, out, seen, data_dir, broker_group)
    elif meta_server is not None:
        for row in _search_source(spark, {"meta_server": meta_server, **environment_options()}, message_id):
            _add(out, seen, _stored_from_row(row, "broker"))
        out.notes.append("consumption history needs the broker's files: run with --data-dir on the broker's machine")
    if archive is not None:
        for row in find_by_id(spark, archive, message_id):
            _add(out, seen, _stored_from_row(row, "archive"))
    out.stored.sort(key=lambda s: (s.stored_at or "", s.subject))
    if not out.stored and not out.dead:
        out.notes.append(f"no subject holds message {message_id} (retention may have removed it)")
    return out


def _add(out: Trace, seen: set[tuple[str, str, int]], stored: Stored) -> None:
    key = (stored.broker_group, stored.subject, stored.sequence)
    if key not in seen:
        seen.add(key)
        out.stored.append(stored)
        return
    for known in out.stored:
        if (known.broker_group, known.subject, known.sequence) == key and stored.found_in not in known.found_in:
            known.found_in += f", {stored.found_in}"


def _stored_from_row(row: dict[str, Any], found_in: str) -> Stored:
    props = row.get("properties") or {}
    return Stored(
        subject=row["subject"],
        broker_group=row["broker_group"],
        sequence=int(row["sequence"]),
        stored_at=row.get("stored_at"),
        error=props.get(ERROR_PROPERTY),
        found_in=found_in,
    )


def _search_source(spark: SparkSession, source: dict[str, str], message_id: str, start: Any = None) -> list[Any]:
    reader = spark.read.format("qmq").options(**source).option("subscribePattern", ".*")
    if start is not None:
        reader = reader.option("startingOffsets", json.dumps(start))
    df = reader.option("failOnDataLoss", "false").load().where(F.col("message_id") == message_id)
    shown = df.select(
        "subject",
        "broker_group",
        "sequence",
        "properties",
        F.date_format("stored_at", ISO_TIMESTAMP).alias("stored_at"),
    )
    return [r.asDict(recursive=True) for r in shown.collect()]


def _trace_files(spark: SparkSession, out: Trace, seen: set[tuple[str, str, int]], data_dir: str, group: str) -> None:
    reader = StoreReader(data_dir)
    day = id_date(out.message_id)
    start = None
    if day is not None:
        since_ms = int((datetime(day.year, day.month, day.day, tzinfo=UTC) - _CLOCK_SLACK).timestamp() * 1000)
        start = to_json({(group, s): reader.seq_at_time(s, since_ms) for s in reader.subjects()})
    for row in _search_source(spark, {"path": data_dir, "brokerGroup": group}, out.message_id, start):
        _add(out, seen, _stored_from_row(row, "data dir"))
    for stored in out.stored:
        if stored.broker_group != group:
            continue
        run = reader.read(stored.subject, stored.sequence, stored.sequence + 1)
        if run.records:
            fields = decode_message(run.data[RECORD_HEADER_BYTES:])
            stored.attempt = delivery_attempt(fields.times)
            error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY)
            stored.error = property_text(error) if error is not None else stored.error
    _deliveries(reader, out, group)
    for letter in reader.dead_letters():
        fields = decode_message(letter.message)
        if fields.message_id != out.message_id:
            continue
        _kind, _subject, consumer_group = parse_internal_subject(letter.dead_subject)
        error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY)
        out.dead.append(
            Dead(
                consumer_group,
                letter.letter,
                fields.times,
                property_text(error) if error is not None else None,
                _iso(letter.dead_at_ms),
                letter.removed,
            )
        )


def _deliveries(reader: StoreReader, out: Trace, group: str) -> None:
    wanted = {(s.subject, s.sequence) for s in out.stored if s.broker_group == group}
    if not wanted:
        return
    pulls: dict[tuple[str, str, str, int], Delivery] = {}  # (subject, group, consumer, pull-log offset)
    for item in reader.actions():
        a = item.action
        if a[0] == act.PULL and len(a) >= 7:  # later items: the ordered flag, the time
            subject, cgroup, consumer, poff, runs = str(a[1]), str(a[2]), str(a[3]), int(a[4]), a[5]
            p = poff
            for seq0, count in runs:
                for subj, seq in wanted:
                    if subj == subject and seq0 <= seq < seq0 + count:
                        key = (subject, cgroup, consumer, p + seq - seq0)
                        pulls[key] = Delivery(subject, cgroup, consumer, key[3], False, "action log")
                p += count
        elif a[0] == act.ACK and len(a) >= 5 and pulls:
            subject, cgroup, consumer = str(a[1]), str(a[2]), str(a[3])
            for key, d in pulls.items():
                if key[:3] == (subject, cgroup, consumer) and any(r[0] <= key[3] < r[1] for r in a[4]):
                    d.acked = True
    progress, at_ms = reader.progress()
    for d in pulls.values():  # acks the action log no longer shows are in the progress
        gp = progress.get(d.subject, d.consumer_group)
        cp = gp.consumers.get(d.consumer_id or "") if gp else None
        if cp is not None and d.pull_log_offset is not None and not d.acked:
            d.acked = d.pull_log_offset < cp.ack_offset or any(s <= d.pull_log_offset < e for s, e in cp.acked)
    out.deliveries.extend(pulls.values())
    for subject, seq in sorted(wanted):
        for gp in progress.groups_of(subject):
            if any(d.subject == subject and d.consumer_group == gp.group for d in pulls.values()):
                continue
            found = False
            for cp in gp.consumers.values():
                for poff, seq0, count in cp.runs:
                    if seq0 <= seq < seq0 + count:
                        p = poff + seq - seq0
                        acked = p < cp.ack_offset or any(s <= p < e for s, e in cp.acked)
                        out.deliveries.append(Delivery(subject, gp.group, cp.consumer_id, p, acked, "checkpoint"))
                        found = True
            if not found and seq < gp.pull_offset:
                # no run names it: a consumer acknowledged it before the kept history, or the
                # group started after it
                out.deliveries.append(Delivery(subject, gp.group, None, None, True, "checkpoint: the group is past it"))
    if at_ms:
        out.notes.append(f"consumer history older than the checkpoint of {_iso(at_ms)} names no consumer")
