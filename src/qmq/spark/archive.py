"""The archive job (``qmq archive``): stored messages → Parquet, incrementally.

Layout of an archive directory::

    subject=<subject>/date=<yyyy-MM-dd>/part-*.parquet   messages (the data source's columns
                                                         but subject; date is created_at's UTC date)
    _groups/part-<run ms>.parquet    consumer groups' lag at each run (subject, group, …)
    _dead/part-<run ms>.parquet      dead letters found since the last run
    _qmq/manifests/<n>.json          the bookkeeping: one manifest per committed batch
    _qmq/work/                       batches being written (ledger.py)

A run reads from where the newest manifest says to what is stored when it starts, writes
its files into a workspace and commits them with a manifest (``ledger.py``): a run that
stops at any point adds nothing, or everything, and the next run goes on from the last
commit. Names starting with ``_`` are hidden from ``spark.read.parquet(archive)``.
``qmq archive --follow`` (``follow.py``) commits the same way, once per micro-batch.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from qmq.client.connection import Connection
from qmq.client.pages import pages
from qmq.client.pages import subjects as subjects_of
from qmq.common.errors import BrokerError, ConfigError
from qmq.common.naming import parse_internal_subject
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.protocol.message import decode_message, decode_properties
from qmq.spark.access import environment_options
from qmq.spark.ledger import ArchiveState, ConflictError, Ledger, Workspace
from qmq.spark.offsets import Positions, SourceOptions, parse_options, to_json
from qmq.spark.records import property_text
from qmq.spark.sources import broker_groups, connect, fetch_bounds
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.reader import StoreReader

log = logging.getLogger(__name__)

GROUPS_DIR = "_groups"
DEAD_DIR = "_dead"
# Runs of one batch when another writer commits first (each reads the new state again).
COMMIT_TRIES = 3
_DEAD_PAGE = 1000
_REQUEST_TIMEOUT_S = 60.0

GROUPS_SCHEMA = pa.schema(
    [
        ("run_at", pa.timestamp("us", tz="UTC")),
        ("broker_group", pa.string()),
        ("subject", pa.string()),
        ("consumer_group", pa.string()),
        ("messages", pa.int64()),
        ("backlog", pa.int64()),
        ("unacked", pa.int64()),
    ]
)
DEAD_SCHEMA = pa.schema(
    [
        ("broker_group", pa.string()),
        ("subject", pa.string()),
        ("consumer_group", pa.string()),
        ("letter", pa.int64()),
        ("message_id", pa.string()),
        ("attempts", pa.int64()),
        ("error", pa.string()),
        ("dead_at", pa.timestamp("us", tz="UTC")),
    ]
)


@dataclass
class ArchiveResult:
    messages: int
    skipped: int  # removed by retention before they were archived
    subjects: int
    dead_letters: int
    groups: int
    seconds: float
    per_subject: dict[str, int]


def source_options(meta_server: str | None, data_dir: str | None, broker_group: str | None) -> dict[str, str]:
    if (meta_server is None) == (data_dir is None):
        raise ConfigError("give exactly one of --meta-server (read through the brokers) or --data-dir (read files)")
    if meta_server is not None:
        return {"meta_server": meta_server, **environment_options()}
    opts = {"path": str(data_dir)}
    if broker_group:
        opts["brokerGroup"] = broker_group
    return opts


def plan_run(state: ArchiveState, bounds: dict[tuple[str, str], tuple[int, int]]) -> tuple[Positions, Positions, int]:
    """Start and end of this run per pair, and how many messages retention removed unarchived."""
    start: Positions = {}
    end: Positions = {}
    skipped = 0
    for pair, (first, stored) in bounds.items():
        done = state.offsets.get(pair, 0)
        begin = max(done, first)
        skipped += max(0, min(first, stored) - done)
        start[pair] = begin
        end[pair] = max(begin, stored)
    return start, end, skipped


def with_date(df: DataFrame) -> DataFrame:
    return df.withColumn("date", F.to_date(F.col("created_at")))


def run_archive(
    spark: SparkSession,
    source: dict[str, str],
    to: Path,
    on_plan: Callable[[int], None] | None = None,
) -> ArchiveResult:
    """Archive what is new since the last commit into ``to``; see the module docstring."""
    t0 = time.monotonic()
    to.mkdir(parents=True, exist_ok=True)
    ledger = Ledger(to)
    options = parse_options({**source, "subscribePattern": ".*"}, streaming=False)
    for attempt in range(1, COMMIT_TRIES + 1):
        state = ledger.load()
        found = fetch_bounds(options)
        start, end, skipped = plan_run(state, found.bounds)
        todo = {p: end[p] - start[p] for p in end if end[p] > start[p]}
        if on_plan is not None:
            on_plan(sum(todo.values()))
        with ledger.workspace() as ws:
            if todo:
                df = (
                    spark.read.format("qmq")
                    .options(**source)
                    .option("subscribePattern", ".*")
                    .option("startingOffsets", json.dumps(to_json(start)))
                    .option("endingOffsets", json.dumps(to_json(end)))
                    .option("failOnDataLoss", "false")
                    .load()
                )
                with_date(df).write.mode("append").partitionBy("subject", "date").parquet(str(ws.path))
            after = ArchiveState(dict(state.offsets), dict(state.dead), state.number)
            groups, dead = stage_lag_and_dead(options, found.bounds, after, ws)
            after.offsets.update(end)
            try:
                ledger.commit(state, after, ws, {"writer": "batch", "messages": sum(todo.values())})
            except ConflictError:
                if attempt == COMMIT_TRIES:
                    raise
                log.info("another archive run committed first; planning this run again")
                continue
        per_subject: dict[str, int] = {}
        for (_g, subject), n in todo.items():
            per_subject[subject] = per_subject.get(subject, 0) + n
        return ArchiveResult(
            messages=sum(todo.values()),
            skipped=skipped,
            subjects=len(per_subject),
            dead_letters=dead,
            groups=groups,
            seconds=round(time.monotonic() - t0, 3),
            per_subject=per_subject,
        )
    raise AssertionError("unreachable: the last try returns or raises")


def stage_lag_and_dead(
    options: SourceOptions, bounds: dict[tuple[str, str], tuple[int, int]], state: ArchiveState, ws: Workspace
) -> tuple[int, int]:
    """Write the consumer groups' lag now and the dead letters new since ``state`` into the
    workspace, and note the letters in ``state``; how many rows of each."""
    run_ms = time.time_ns() // 1_000_000
    groups = _lag_rows(options, bounds, run_ms)
    dead = _dead_rows(options, state)
    if groups:
        _write_table(ws.path / GROUPS_DIR, run_ms, pa.Table.from_pylist(groups, GROUPS_SCHEMA))
    if dead:
        _write_table(ws.path / DEAD_DIR, run_ms, pa.Table.from_pylist(dead, DEAD_SCHEMA))
    for row in dead:
        key = f"{row['broker_group']}/%DEAD_RETRY%{row['subject']}%{row['consumer_group']}"
        state.dead[key] = max(state.dead.get(key, -1), int(row["letter"]))
    return len(groups), len(dead)


def _write_table(directory: Path, run_ms: int, table: pa.Table) -> None:
    """Into a workspace: the manifest's commit makes it part of the archive."""
    directory.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, directory / f"part-{run_ms}.parquet")


def _ts(ms: int) -> Any:
    return pa.scalar(ms * 1000, pa.timestamp("us", tz="UTC")).as_py()


def _lag_rows(
    options: SourceOptions, bounds: dict[tuple[str, str], tuple[int, int]], run_ms: int
) -> list[dict[str, Any]]:
    """Each consumer group's lag now: from the brokers (LAG), or from the files (progress)."""
    if options.path is not None:
        reader = StoreReader(options.path)
        progress, _at = reader.progress()
        rows = []
        for gp in progress.groups.values():
            stored = bounds.get((options.broker_group, gp.subject), (0, 0))[1]
            unacked = sum(cp.unacked for cp in gp.consumers.values())
            rows.append(_lag_row(run_ms, options.broker_group, gp.subject, gp.group, stored, gp.pull_offset, unacked))
        return rows
    assert options.meta_server is not None
    return asyncio.run(_remote_lag(options, run_ms))


def _lag_row(
    run_ms: int, broker_group: str, subject: str, group: str, stored: int, pull_offset: int, unacked: int
) -> dict[str, Any]:
    return {
        "run_at": _ts(run_ms),
        "broker_group": broker_group,
        "subject": subject,
        "consumer_group": group,
        "messages": stored,
        "backlog": max(0, stored - pull_offset),
        "unacked": unacked,
    }


async def _remote_lag(options: SourceOptions, run_ms: int) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async for group_name, conn, subject, g in _subject_groups(options, user_subjects_only=False):
        try:
            # limit 0: the group's figures without its consumers
            h = answer_of(await conn.request(RequestCode.LAG, {"subject": subject, "group": g, "limit": 0}))
        except BrokerError as exc:
            log.warning("no lag of group %r of %r: %s", g, subject, exc)
            continue
        rows.append(
            _lag_row(run_ms, group_name, subject, g, int(h["messages"]), int(h["pull_offset"]), int(h["unacked"]))
        )
    return rows


async def _subject_groups(
    options: SourceOptions, *, user_subjects_only: bool
) -> AsyncIterator[tuple[str, Connection, str, str]]:
    """Every (broker group, its connection, subject, consumer group) the brokers know, each
    broker group's requests bounded by _REQUEST_TIMEOUT_S together."""
    assert options.meta_server is not None
    for group_name, address in sorted((await broker_groups(options.meta_server, options.access)).items()):
        conn = connect(address, options.meta_server, options.access)
        try:
            async with asyncio.timeout(_REQUEST_TIMEOUT_S):
                async for item in subjects_of(conn):
                    subject = item["subject"]
                    if user_subjects_only and subject.startswith("%"):
                        continue
                    for g in _named_groups(item):
                        yield group_name, conn, subject, g
        finally:
            await conn.close()


def _named_groups(item: dict[str, Any]) -> list[str]:
    """The consumer groups of a SUBJECTS item the broker takes by name: a broadcast consumer's
    own group (``<group>%<consumer id>``) is refused by LAG and DEAD_LETTERS, and never retried."""
    return [g for g in item.get("groups", []) if isinstance(g, str) and "%" not in g]


def _dead_rows(options: SourceOptions, state: ArchiveState) -> list[dict[str, Any]]:
    """Dead letters numbered after the last run's, of every (subject, group)."""
    if options.path is not None:
        rows = []
        for letter in StoreReader(options.path).dead_letters():
            key = f"{options.broker_group}/{letter.dead_subject}"
            if letter.letter <= state.dead.get(key, -1):
                continue
            _kind, subject, group = parse_internal_subject(letter.dead_subject)
            fields = decode_message(letter.message)
            error = decode_properties(fields.properties_raw).get(ERROR_PROPERTY)
            rows.append(
                _dead_row(
                    options.broker_group,
                    subject,
                    group,
                    letter.letter,
                    fields.message_id,
                    fields.times,
                    property_text(error) if error is not None else None,
                    letter.dead_at_ms,
                )
            )
        return rows
    assert options.meta_server is not None
    return asyncio.run(_remote_dead(options, state))


def _dead_row(
    broker_group: str,
    subject: str,
    group: str,
    letter: int,
    message_id: str,
    attempts: int,
    error: str | None,
    dead_at_ms: int,
) -> dict[str, Any]:
    return {
        "broker_group": broker_group,
        "subject": subject,
        "consumer_group": group,
        "letter": letter,
        "message_id": message_id,
        "attempts": attempts,
        "error": error,
        "dead_at": _ts(dead_at_ms),
    }


async def _remote_dead(options: SourceOptions, state: ArchiveState) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    async for group_name, conn, subject, g in _subject_groups(options, user_subjects_only=True):
        after = state.dead.get(f"{group_name}/%DEAD_RETRY%{subject}%{g}", -1)
        header = {"subject": subject, "group": g, "limit": _DEAD_PAGE, "after": after}
        async for page in pages(conn, RequestCode.DEAD_LETTERS, header):
            for x in page.get("letters", []):
                rows.append(
                    _dead_row(
                        group_name,
                        subject,
                        g,
                        int(x["letter"]),
                        str(x["message_id"]),
                        int(x["attempts"]),
                        str(x.get("error") or "") or None,
                        int(x["dead_at_ms"]),
                    )
                )
    return rows
