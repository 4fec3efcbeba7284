"""The query job (``qmq query``): find messages in an archive, as QMQ's backup server does.

By message id: ids the SDK makes start with their UTC creation time (``yyMMddHHmmssSSS``),
and the archive is partitioned by creation date, so a lookup reads only the date directories
of that day and the days either side (a producer's clock may sit across midnight from the
broker's). Parquet's row-group statistics then skip most of what is left. An id without such
a prefix is looked up in every date.

By subject: the subject's directory, the dates between ``since`` and ``until``, and
optionally a property equal to a value (in its string form, see ``records.py``).
"""

from __future__ import annotations

import base64
import re
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, date, datetime, timedelta
from pathlib import Path
from typing import Any

from pyspark.sql import DataFrame, SparkSession
from pyspark.sql import functions as F

from qmq.common.errors import ConfigError

_ID_TIME = re.compile(r"^(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})(\d{2})(\d{3})")
_DATE_DIR = "date="
LIMIT_DEFAULT = 100
_LIMIT_MAX = 1_000_000


def id_date(message_id: str) -> date | None:
    """The UTC creation date an SDK-made message id carries, or None if it carries none."""
    m = _ID_TIME.match(message_id)
    if m is None:
        return None
    yy, mo, dd, hh, mi, ss, _ms = (int(g) for g in m.groups())
    try:
        return datetime(2000 + yy, mo, dd, hh, mi, ss, tzinfo=UTC).date()
    except ValueError:
        return None


def _check_archive(archive: Path) -> None:
    if not archive.is_dir():
        raise ConfigError(f"archive {str(archive)!r} is not a directory; pass the --to of `qmq archive`")


def date_dirs(archive: Path, days: set[str] | None, subject_dir: str | None = None) -> list[str]:
    """Leaf directories ``subject=*/date=*`` of the archive whose date is in ``days`` (all if None)."""
    out = []
    pattern = f"{subject_dir or 'subject=*'}/{_DATE_DIR}*"
    for path in sorted(archive.glob(pattern)):
        if path.is_dir() and (days is None or path.name[len(_DATE_DIR) :] in days):
            out.append(str(path))
    return out


def _read(spark: SparkSession, archive: Path, paths: list[str]) -> DataFrame | None:
    if not paths:
        return None
    return spark.read.option("basePath", str(archive)).parquet(*paths)


def find_by_id(spark: SparkSession, archive: Path, message_id: str) -> list[dict[str, Any]]:
    """Every archived message with ``message_id`` (one per subject it was stored in)."""
    _check_archive(archive)
    day = id_date(message_id)
    days = None if day is None else {(day + timedelta(days=k)).isoformat() for k in (-1, 0, 1)}
    df = _read(spark, archive, date_dirs(archive, days))
    if df is None:
        return []
    found = df.where(F.col("message_id") == message_id).orderBy("stored_at")
    return _collect(found)


def _parse_time(text: str, what: str) -> datetime:
    try:
        when = datetime.fromisoformat(text.strip())
    except ValueError:
        raise ConfigError(f"{what} {text!r} is not an ISO 8601 time; use e.g. 2026-11-21T18:00:00+08:00") from None
    return when if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass(frozen=True, slots=True)
class SubjectQuery:
    subject: str
    since: str | None = None
    until: str | None = None
    properties: tuple[tuple[str, str], ...] = ()
    limit: int = LIMIT_DEFAULT


def find_by_subject(spark: SparkSession, archive: Path, q: SubjectQuery) -> list[dict[str, Any]]:
    """Messages of a subject created in ``[since, until)`` (UTC if no offset is given), oldest first."""
    _check_archive(archive)
    if not 1 <= q.limit <= _LIMIT_MAX:
        raise ConfigError(f"--limit {q.limit} is outside 1..{_LIMIT_MAX}")
    since = _parse_time(q.since, "--since") if q.since else None
    until = _parse_time(q.until, "--until") if q.until else None
    days: set[str] | None = None
    if since is not None or until is not None:
        lo = (since or datetime(2000, 1, 1, tzinfo=UTC)).astimezone(UTC).date()
        hi = (until or datetime.now(UTC) + timedelta(days=1)).astimezone(UTC).date()
        if hi < lo:
            raise ConfigError(f"--until {q.until} is before --since {q.since}")
        days = {(lo + timedelta(days=k)).isoformat() for k in range((hi - lo).days + 1)}
    # the subject's directory as Spark escaped it: found by reading the value back, not by escaping
    paths = [p for p in date_dirs(archive, days) if _subject_of(p) == q.subject]
    df = _read(spark, archive, paths)
    if df is None:
        return []
    if since is not None:
        df = df.where(F.col("created_at") >= F.lit(since))
    if until is not None:
        df = df.where(F.col("created_at") < F.lit(until))
    for key, value in q.properties:
        df = df.where(F.col("properties").getItem(key) == value)
    return _collect(df.orderBy("created_at", "sequence").limit(q.limit))


# Spark datetime pattern of ISO 8601 text; "XXX" is the zone offset (Z for UTC), not a marker.
ISO_TIMESTAMP = "yyyy-MM-dd'T'HH:mm:ss.SSSXXX"


def _collect(df: DataFrame) -> list[dict[str, Any]]:
    """Rows as dicts; times as ISO 8601 text made by Spark (collected timestamps would be naive)."""
    shown = df.withColumn("created_at", F.date_format("created_at", ISO_TIMESTAMP)).withColumn(
        "stored_at", F.date_format("stored_at", ISO_TIMESTAMP)
    )
    return [r.asDict(recursive=True) for r in shown.collect()]


def _subject_of(date_path: str) -> str:
    """The subject of ``.../subject=<escaped>/date=...``, unescaped as Spark escapes it (%XX)."""
    name = Path(date_path).parent.name[len("subject=") :]
    return re.sub(r"%([0-9A-Fa-f]{2})", lambda m: chr(int(m.group(1), 16)), name)


def body_text(body: bytes | None) -> str | None:
    """A body for people: its UTF-8 text, or ``base64:`` and its base64 when it is not text."""
    if body is None:
        return None
    try:
        return bytes(body).decode("utf-8")
    except UnicodeDecodeError:
        return "base64:" + base64.b64encode(bytes(body)).decode("ascii")


def json_ready(rows: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Rows with JSON-friendly values: bodies per ``body_text``, dates in ISO 8601."""
    for row in rows:
        out: dict[str, Any] = {k: v.isoformat() if isinstance(v, date) else v for k, v in row.items()}
        if "body" in out:
            out["body"] = body_text(row["body"])
        yield out
