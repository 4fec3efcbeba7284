"""Options and offsets of the ``qmq`` data source, as pure functions (no Spark, no I/O).

Names, defaults and the offset JSON follow Spark's Kafka source. An offset is a sequence
number of one subject in one broker group (the next one to read); offsets of a read are
JSON ``{"<subject>": {"<broker group>": sequence}}``, where ``-2`` means the earliest kept
sequence and ``-1`` the latest (the next one to be stored).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from qmq.common.errors import ConfigError
from qmq.spark.access import Access, access_of

EARLIEST = -2
LATEST = -1

# A (broker group, subject) pair: the unit of ordering and of offsets.
Pair = tuple[str, str]
# Resolved positions: pair -> sequence.
Positions = dict[Pair, int]
# What an offset option says: "earliest", "latest", or a per-pair sequence (maybe -2 / -1).
OffsetSpec = Literal["earliest", "latest"] | dict[Pair, int]

DEFAULT_BROKER_GROUP = "broker-1"
RECORDS_PER_PARTITION_DEFAULT = 250_000
_PARTITIONS_MAX = 100_000


@dataclass(frozen=True, slots=True)
class SourceOptions:
    """The options of a read (batch or stream), checked."""

    meta_server: str | None
    path: str | None
    broker_group: str  # the group name given to rows read from ``path``
    subscribe: tuple[str, ...]
    pattern: str | None
    starting: OffsetSpec
    ending: OffsetSpec
    max_offsets_per_trigger: int | None
    fail_on_data_loss: bool
    min_partitions: int | None
    records_per_partition: int
    access: Access  # the app, secret and CA of connections to the cluster

    def selects(self, subject: str) -> bool:
        if self.pattern is not None:
            return re.fullmatch(self.pattern, subject) is not None
        return subject in self.subscribe


def _bool(options: Mapping[str, str], key: str, default: bool) -> bool:
    raw = options.get(key.lower())
    if raw is None:
        return default
    text = str(raw).strip().lower()
    if text not in ("true", "false"):
        raise ConfigError(f"option {key}={raw!r} is not true or false")
    return text == "true"


def _positive(options: Mapping[str, str], key: str) -> int | None:
    raw = options.get(key.lower())
    if raw is None:
        return None
    try:
        value = int(str(raw).strip())
    except ValueError:
        raise ConfigError(f"option {key}={raw!r} is not a whole number") from None
    if value <= 0:
        raise ConfigError(f"option {key}={value} must be at least 1")
    return value


def parse_offsets(key: str, raw: str | None, default: OffsetSpec) -> OffsetSpec:
    """``earliest``, ``latest`` or Kafka-style JSON ``{"subject": {"broker group": seq}}``."""
    if raw is None:
        return default
    text = str(raw).strip()
    if text.lower() in ("earliest", "latest"):
        return "earliest" if text.lower() == "earliest" else "latest"
    try:
        doc = json.loads(text)
    except ValueError:
        raise ConfigError(
            f"option {key}={text[:200]!r} is neither earliest, latest nor JSON like "
            '{"order.paid": {"broker-1": 42}}'
        ) from None
    if not isinstance(doc, dict):
        raise ConfigError(f"option {key}: the JSON must be an object of subjects, got {type(doc).__name__}")
    out: dict[Pair, int] = {}
    for subject, groups in doc.items():
        if not isinstance(groups, dict):
            raise ConfigError(f"option {key}: subject {subject!r} must map broker groups to sequences, got {groups!r}")
        for group, seq in groups.items():
            if isinstance(seq, bool) or not isinstance(seq, int) or seq < EARLIEST:
                raise ConfigError(
                    f"option {key}: {subject!r} in broker group {group!r} has offset {seq!r}; "
                    "use a sequence >= 0, -2 (earliest) or -1 (latest)"
                )
            out[(str(group), str(subject))] = seq
    return out


def parse_options(options: Mapping[str, str], streaming: bool) -> SourceOptions:
    """Check the options of a read; ConfigError naming the bad one and what to do."""
    opts = {str(k).lower(): str(v) for k, v in options.items()}
    meta_server = opts.get("meta_server") or opts.get("metaserver")
    path = opts.get("path")
    if (meta_server is None) == (path is None):
        raise ConfigError(
            "give exactly one of option meta_server (the URL printed by `qmq ready`) or option path "
            "(a broker's data directory, read offline)"
        )
    subscribe_raw = opts.get("subscribe")
    pattern = opts.get("subscribepattern")
    if (subscribe_raw is None) == (pattern is None):
        raise ConfigError(
            "give exactly one of option subscribe (subjects, comma-separated) or subscribePattern (a regex)"
        )
    subscribe = tuple(s.strip() for s in (subscribe_raw or "").split(",") if s.strip())
    if subscribe_raw is not None and not subscribe:
        raise ConfigError(f"option subscribe={subscribe_raw!r} names no subject")
    if pattern is not None:
        try:
            re.compile(pattern)
        except re.error as exc:
            raise ConfigError(f"option subscribePattern={pattern!r} is not a valid regex: {exc}") from None
    starting = parse_offsets("startingOffsets", opts.get("startingoffsets"), "latest" if streaming else "earliest")
    ending = parse_offsets("endingOffsets", opts.get("endingoffsets"), "latest")
    if streaming and "endingoffsets" in opts:
        raise ConfigError("option endingOffsets is for batch reads; a stream reads on as messages arrive")
    if not streaming and starting == "latest":
        raise ConfigError("startingOffsets=latest would read nothing in a batch read; use earliest or JSON")
    if not streaming and ending == "earliest":
        raise ConfigError("endingOffsets=earliest would read nothing; use latest or JSON")
    per_partition = _positive(opts, "maxRecordsPerPartition") or RECORDS_PER_PARTITION_DEFAULT
    return SourceOptions(
        access=access_of(opts),
        meta_server=meta_server,
        path=path,
        broker_group=opts.get("brokergroup", DEFAULT_BROKER_GROUP),
        subscribe=subscribe,
        pattern=pattern,
        starting=starting,
        ending=ending,
        max_offsets_per_trigger=_positive(opts, "maxOffsetsPerTrigger"),
        fail_on_data_loss=_bool(opts, "failOnDataLoss", True),
        min_partitions=_positive(opts, "minPartitions"),
        records_per_partition=per_partition,
    )


def resolve(
    spec: OffsetSpec, bounds: Mapping[Pair, tuple[int, int]], missing: Literal["earliest", "latest"]
) -> Positions:
    """Sequences for every pair of ``bounds`` (pair -> (first kept, next)) under ``spec``.

    A pair the JSON does not name takes ``missing``; -2 / -1 take the pair's bounds. A
    sequence beyond the next one is kept as given (the read then waits for it).
    """
    out: Positions = {}
    for pair, (first, end) in bounds.items():
        if spec == "earliest":
            want = EARLIEST
        elif spec == "latest":
            want = LATEST
        else:
            want = spec.get(pair, EARLIEST if missing == "earliest" else LATEST)
        out[pair] = first if want == EARLIEST else end if want == LATEST else want
    return out


def to_json(positions: Positions) -> dict[str, dict[str, int]]:
    """Positions as the offset JSON object (sorted, so equal offsets compare equal as text)."""
    out: dict[str, dict[str, int]] = {}
    for (group, subject), seq in sorted(positions.items(), key=lambda kv: (kv[0][1], kv[0][0])):
        out.setdefault(subject, {})[group] = seq
    return out


def from_json(doc: Mapping[str, Mapping[str, int]]) -> Positions:
    return {(str(group), str(subject)): int(seq) for subject, groups in doc.items() for group, seq in groups.items()}


def limit(start: Positions, latest: Positions, max_rows: int | None) -> Positions:
    """End positions at most ``max_rows`` past ``start`` in all, shared in proportion to each
    pair's backlog (as Kafka's maxOffsetsPerTrigger). A pair not in ``start`` starts at its
    position in ``latest`` (the caller puts new pairs into ``start`` where they should
    start); a pair gone from ``latest`` (broker group unavailable) stays where it was.
    Positions never move back."""
    base = {p: start.get(p, latest[p]) for p in latest}
    backlog = {p: max(0, latest[p] - base[p]) for p in latest}
    total = sum(backlog.values())
    end = dict(start)
    if max_rows is None or total <= max_rows:
        end.update({p: base[p] + backlog[p] for p in latest})
        return end
    given = 0
    for p in sorted(latest):
        share = backlog[p] * max_rows // total
        end[p] = base[p] + share
        given += share
    # what floor division left over goes one by one to the pairs with most left behind
    left = max_rows - given
    for p in sorted(latest, key=lambda q: (-(backlog[q] - (end[q] - base[q])), q)):
        if left <= 0:
            break
        if end[p] - base[p] < backlog[p]:
            end[p] += 1
            left -= 1
    return end


@dataclass(frozen=True, slots=True)
class Slice:
    """One partition of a read: ``[start, end)`` of a subject in a broker group."""

    broker_group: str
    subject: str
    start: int
    end: int


def plan(start: Positions, end: Positions, records_per_partition: int, min_partitions: int | None) -> list[Slice]:
    """Split the ranges ``start → end`` into slices of at most ``records_per_partition``
    records, and into at least ``min_partitions`` slices when there are that many records."""
    ranges = [(p, start.get(p, end[p]), end[p]) for p in sorted(end) if end[p] > start.get(p, end[p])]
    total = sum(e - s for _p, s, e in ranges)
    if not total:
        return []
    per = records_per_partition
    if min_partitions is not None and min_partitions > 1:
        per = min(per, max(1, -(-total // min_partitions)))
    if total // per > _PARTITIONS_MAX:
        per = -(-total // _PARTITIONS_MAX)
    out: list[Slice] = []
    for (group, subject), s, e in ranges:
        pieces = -(-(e - s) // per)
        step = -(-(e - s) // pieces)
        for a in range(s, e, step):
            out.append(Slice(group, subject, a, min(e, a + step)))
    return out
