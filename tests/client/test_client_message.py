"""Outgoing messages: ids, checks at the call site, and the encoding a producer sends."""

from __future__ import annotations

import re
import threading
from datetime import UTC, datetime

import pytest

from qmq import InvalidMessageError, InvalidSubjectError, MessageTooLargeError
from qmq.client.message import MESSAGE_IDS, Message
from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.message import PropertyValue, decode_message, decode_properties

ID_RE = re.compile(r"^(\d{15})\.([0-9a-f]{6})\.(\d+)\.(\d+)$")


def test_generated_id_has_time_node_pid_and_counter() -> None:
    m = Message("order.paid")
    match = ID_RE.match(m.message_id)
    assert match is not None, m.message_id
    stamp, node, pid, _counter = match.groups()
    assert node == MESSAGE_IDS.node
    assert int(pid) == MESSAGE_IDS.pid
    # The time prefix is the UTC creation time to the millisecond.
    assert stamp == m.created_at.strftime("%y%m%d%H%M%S") + f"{m.created_ms % 1000:03d}"
    assert m.created_at.tzinfo is UTC
    assert abs((datetime.now(UTC) - m.created_at).total_seconds()) < 60


def test_ids_are_unique_and_counted_across_threads() -> None:
    ids: list[str] = []
    lock = threading.Lock()

    def make() -> None:
        local = [Message("s").message_id for _ in range(2000)]
        with lock:
            ids.extend(local)

    threads = [threading.Thread(target=make) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(ids)) == len(ids) == 8000
    counters = sorted(int(ID_RE.match(i).group(4)) for i in ids)  # type: ignore[union-attr]
    assert counters == list(range(counters[0], counters[0] + 8000))


def test_properties_of_every_type_round_trip_through_the_encoding() -> None:
    m = Message("s", body="héllo")
    values: dict[str, PropertyValue] = {"s": "42", "i": -(2**63), "u": 2**64 - 1, "f": 1.5, "t": True, "b": b"\x00\xff"}
    for k, v in values.items():
        m.set_property(k, v)
    m.add_tag("red")
    m.add_tag("blue")
    fields = decode_message(m.encode(times=3))
    assert fields.subject == "s"
    assert fields.message_id == m.message_id
    assert fields.tags == ["red", "blue"]
    assert decode_properties(fields.properties_raw) == values
    assert fields.body == "héllo".encode()
    assert fields.created_ms == m.created_ms
    assert fields.times == 3
    assert m.get_property("i") == -(2**63)
    assert m.get_property("missing", "dflt") == "dflt"
    assert dict(m.properties) == values


@pytest.mark.parametrize(
    ("key", "value", "named"),
    [
        ("k", [1], "k"),
        ("k", None, "k"),
        ("k", 2**64, "k"),
        ("k", float("nan"), "k"),
        ("", "v", "property name"),
        (7, "v", "property name"),
        ("x" * 300, "v", "characters"),
    ],
)
def test_a_bad_property_is_refused_where_it_is_set(key: object, value: object, named: str) -> None:
    m = Message("s")
    with pytest.raises(InvalidMessageError, match=re.escape(named)):
        m.set_property(key, value)  # type: ignore[arg-type]
    assert dict(m.properties) == {}


def test_property_count_is_bounded() -> None:
    m = Message("s")
    for i in range(DEFAULT_LIMITS.properties_max):
        m.set_property(f"k{i}", i)
    m.set_property("k0", "replacing an existing key is fine")
    with pytest.raises(InvalidMessageError, match="properties"):
        m.set_property("one-more", 1)


def test_properties_view_is_read_only() -> None:
    m = Message("s", properties={"a": 1})
    with pytest.raises(TypeError):
        m.properties["b"] = 2  # type: ignore[index]


def test_tags_are_bounded_checked_and_kept_once() -> None:
    m = Message("s", tags=["a", "a"])
    assert m.tags == ("a",)
    for i in range(DEFAULT_LIMITS.tags_max - 1):
        m.add_tag(f"t{i}")
    with pytest.raises(InvalidMessageError, match="10 tags"):
        m.add_tag("eleventh")
    with pytest.raises(InvalidMessageError, match="tag"):
        Message("s").add_tag("")
    with pytest.raises(InvalidMessageError, match="tag_chars_max"):
        Message("s").add_tag("x" * 65)


@pytest.mark.parametrize("subject", ["", "has space", "a/b", "50%", "x" * 101, None])
def test_a_bad_subject_is_refused_with_its_name(subject: object) -> None:
    with pytest.raises(InvalidSubjectError):
        Message(subject)  # type: ignore[arg-type]


def test_retry_subjects_are_valid_subjects() -> None:
    assert Message("%RETRY%order.paid%billing").subject == "%RETRY%order.paid%billing"


def test_body_accepts_bytes_like_and_str_only() -> None:
    m = Message("s")
    m.body = bytearray(b"ab")
    assert m.body == b"ab"
    m.body = memoryview(b"cd")
    assert m.body == b"cd"
    m.body = "é"
    assert m.body == "é".encode()
    with pytest.raises(InvalidMessageError, match="int"):
        m.body = 5  # type: ignore[assignment]


def test_an_oversized_message_is_refused_before_it_is_buffered() -> None:
    m = Message("s")
    with pytest.raises(MessageTooLargeError, match="body_bytes_max"):
        m.body = b"x" * (DEFAULT_LIMITS.body_bytes_max + 1)
    m.body = b"x" * DEFAULT_LIMITS.body_bytes_max
    m.set_property("k", "v" * (DEFAULT_LIMITS.message_bytes_max - DEFAULT_LIMITS.body_bytes_max))
    with pytest.raises(MessageTooLargeError, match=re.escape(m.message_id)):
        m.encode()


def test_custom_message_ids_are_checked() -> None:
    assert Message("s", message_id="order-42").message_id == "order-42"
    for bad in ["", "has space", "x" * 129, "é" * 128, "tab\there"]:
        with pytest.raises(InvalidMessageError, match="message id"):
            Message("s", message_id=bad)
