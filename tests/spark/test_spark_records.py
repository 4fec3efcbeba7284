"""Stored records → Arrow batches, and the string form of properties (no Spark needed)."""

from __future__ import annotations

from datetime import UTC, datetime

import pyarrow as pa
import pytest

from qmq.protocol.message import encode_message, encode_properties, encode_tags
from qmq.protocol.record import record_header
from qmq.spark.records import ARROW_SCHEMA, property_text, records_to_batch


def _record(
    seq: int, message_id: str, body: bytes, tags: list[str], props: dict[str, object], created_ms: int
) -> bytes:
    m = encode_message(
        b"order.paid",
        message_id.encode(),
        encode_tags(tags),
        len(tags),
        encode_properties(props),  # type: ignore[arg-type]
        body,
        created_ms,
    )
    return record_header(m, seq, created_ms + 5) + m


@pytest.mark.parametrize(
    ("value", "text"),
    [
        ("plain", "plain"),
        ("", ""),
        (42, "42"),
        (-7, "-7"),
        (2**63, "9223372036854775808"),
        (1.5, "1.5"),
        (0.1, "0.1"),
        (1e20, "1e+20"),
        (True, "true"),
        (False, "false"),
        (b"\x00\x01", "base64:AAE="),
        (b"", "base64:"),
    ],
)
def test_property_values_have_one_documented_string_form(value: object, text: str) -> None:
    assert property_text(value) == text


def test_a_batch_holds_every_field_of_every_record_in_the_declared_schema() -> None:
    created = 1_763_700_000_123
    data = b"".join(
        [
            _record(10, "a", b"x" * 100, [], {}, created),
            _record(11, "bb", b"", ["vip", "eu"], {"k": "v", "n": 3, "raw": b"\xff", "ok": True}, created + 1),
            _record(12, "ccc", "ü".encode(), ["t"], {}, created + 2),
        ]
    )
    batch = records_to_batch(data, "order.paid", "broker-1")
    batch.validate(full=True)
    assert batch.schema == ARROW_SCHEMA
    rows = batch.to_pylist()
    assert [r["sequence"] for r in rows] == [10, 11, 12]
    assert [r["message_id"] for r in rows] == ["a", "bb", "ccc"]
    assert [r["body"] for r in rows] == [b"x" * 100, b"", "ü".encode()]
    assert [r["tags"] for r in rows] == [[], ["vip", "eu"], ["t"]]
    assert [dict(r["properties"]) for r in rows] == [{}, {"k": "v", "n": "3", "raw": "base64:/w==", "ok": "true"}, {}]
    assert {r["subject"] for r in rows} == {"order.paid"}
    assert {r["broker_group"] for r in rows} == {"broker-1"}
    assert rows[0]["created_at"] == datetime.fromtimestamp(created / 1000, tz=UTC)
    assert rows[2]["stored_at"] == datetime.fromtimestamp((created + 7) / 1000, tz=UTC)


def test_a_count_cuts_the_batch_and_no_records_make_an_empty_batch() -> None:
    data = b"".join(_record(i, f"id{i}", b"b", [], {}, 1_000) for i in range(5))
    assert records_to_batch(data, "s", "g", count=3).num_rows == 3
    empty = records_to_batch(b"", "s", "g")
    assert empty.num_rows == 0
    assert empty.schema == ARROW_SCHEMA


def test_a_record_running_past_the_buffer_is_refused() -> None:
    data = _record(0, "a", b"body", [], {}, 1_000)
    with pytest.raises(ValueError, match="past the end"):
        records_to_batch(data[:-2], "s", "g")


def test_timestamps_are_utc_microseconds() -> None:
    assert ARROW_SCHEMA.field("created_at").type == pa.timestamp("us", tz="UTC")
