"""Message codec: encode/decode round trips, the broker's batch scanner, with_times and the checks."""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.common.errors import InvalidMessageError
from qmq.common.limits import Limits
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import (
    HEADER,
    HEADER_BYTES,
    PropertyValue,
    check_property,
    check_tag,
    decode_message,
    decode_properties,
    decode_tags,
    encode_message,
    encode_properties,
    encode_tags,
    scan_batch,
    with_times,
)


@dataclass
class Msg:
    subject: str = "orders.created"
    message_id: str = "m-1"
    tags: list[str] = field(default_factory=list)
    props: dict[str, PropertyValue] = field(default_factory=dict)
    body: bytes = b""
    created_ms: int = 1_700_000_000_000
    deliver_at_ms: int = 0
    times: int = 0

    def encode(self) -> bytes:
        return encode_message(
            self.subject.encode(),
            self.message_id.encode(),
            encode_tags(self.tags),
            len(self.tags),
            encode_properties(self.props),
            self.body,
            self.created_ms,
            self.deliver_at_ms,
            self.times,
        )


def assert_decodes_to(data: bytes, msg: Msg, pos: int = 0, length: int | None = None) -> None:
    got = decode_message(data, pos, length)
    assert got.subject == msg.subject
    assert got.message_id == msg.message_id
    assert got.tags == msg.tags
    props = decode_properties(got.properties_raw)
    assert props == msg.props
    # bool == int and 1.0 == 1 in Python; the types must survive too.
    assert {k: type(v) for k, v in props.items()} == {k: type(v) for k, v in msg.props.items()}
    assert got.body == msg.body
    assert (got.created_ms, got.deliver_at_ms, got.times) == (msg.created_ms, msg.deliver_at_ms, msg.times)


ALL_PROPERTY_TYPES: dict[str, PropertyValue] = {
    "str": "värde",
    "empty": "",
    "int": -(2**63),
    "uint": 2**64 - 1,
    "zero": 0,
    "float": -1.5e300,
    "true": True,
    "false": False,
    "bytes": b"\x00\xff\x80",
}

CASES = {
    "minimal": Msg(),
    "unicode subject": Msg(subject="订单.créé-✓", message_id="ид-1"),
    "ten tags": Msg(tags=[f"t{i}" for i in range(10)]),
    "unicode tags": Msg(tags=["é" * 32, "标签"]),
    "every property type": Msg(props=ALL_PROPERTY_TYPES),
    "large body": Msg(body=bytes(range(256)) * 4096),
    "delayed retry": Msg(deliver_at_ms=1_800_000_000_000, times=65535),
    "negative times": Msg(created_ms=-1, deliver_at_ms=-(2**63)),
    "long id": Msg(message_id="i" * 128),
}


@pytest.mark.smoke
@pytest.mark.parametrize("msg", CASES.values(), ids=list(CASES))
def test_round_trip_keeps_every_field(msg: Msg) -> None:
    assert_decodes_to(msg.encode(), msg)


names = st.text(min_size=1, max_size=40)
property_values = st.one_of(
    st.text(max_size=20),
    st.integers(-(2**63), 2**64 - 1),
    st.floats(allow_nan=False, allow_infinity=False),
    st.booleans(),
    st.binary(max_size=20),
)
messages = st.builds(
    Msg,
    subject=names,
    message_id=st.text(max_size=30),
    tags=st.lists(st.text(min_size=1, max_size=16), max_size=10),
    props=st.dictionaries(st.text(min_size=1, max_size=10), property_values, max_size=5),
    body=st.binary(max_size=200),
    created_ms=st.integers(-(2**63), 2**63 - 1),
    deliver_at_ms=st.integers(-(2**63), 2**63 - 1),
    times=st.integers(0, 0xFFFF),
)


@settings(max_examples=200, deadline=None)
@given(messages)
def test_round_trip_of_generated_messages(msg: Msg) -> None:
    for key, value in msg.props.items():
        check_property(key, value)
    for tag in msg.tags:
        check_tag(tag)

    assert_decodes_to(msg.encode(), msg)


# ---- scan_batch ----


def batch_of(msgs: list[Msg]) -> bytes:
    return b"".join(m.encode() for m in msgs)


def test_scan_batch_reads_positions_and_names_of_every_message() -> None:
    msgs = [
        Msg(
            subject=f"subject-{i % 7}-é",
            message_id=f"id-{i}",
            tags=[f"tag{j}" for j in range(i % 11)],
            props={"n": i} if i % 3 else {},
            body=b"b" * (i * 13 % 300),
            deliver_at_ms=i * 1000,
        )
        for i in range(500)
    ]
    body = batch_of(msgs)

    scanned = scan_batch(body)

    assert len(scanned) == len(msgs)
    pos = 0
    for s, m in zip(scanned, msgs, strict=True):
        encoded = m.encode()
        assert (s.pos, s.length) == (pos, len(encoded))
        assert body[s.pos : s.pos + s.length] == encoded
        assert s.subject == m.subject.encode()
        assert s.message_id == m.message_id.encode()
        assert s.tags == encode_tags(m.tags)
        assert s.deliver_at_ms == m.deliver_at_ms
        assert_decodes_to(body, m, s.pos, s.length)
        pos += len(encoded)


def test_scan_batch_of_nothing_is_empty() -> None:
    assert scan_batch(b"") == []


def test_scan_batch_allows_batch_messages_max_and_refuses_one_more() -> None:
    limits = Limits(batch_messages_max=5)

    assert len(scan_batch(batch_of([Msg()] * 5), limits)) == 5
    with pytest.raises(RemoteProtocolError, match=r"batch_messages_max 5"):
        scan_batch(batch_of([Msg()] * 6), limits)


def test_every_cut_inside_a_message_is_refused_and_cuts_between_messages_are_not() -> None:
    msgs = [Msg(tags=["a", "bc"], props={"k": 1}, body=b"xyz"), Msg(subject="s2"), Msg(message_id="")]
    body = batch_of(msgs)
    boundaries = {0}
    for m in msgs:
        boundaries.add(max(boundaries) + len(m.encode()))

    for cut in range(len(body) + 1):
        if cut in boundaries:
            assert len(scan_batch(body[:cut])) == sorted(boundaries).index(cut)
        else:
            with pytest.raises(RemoteProtocolError, match=r"message \d of the batch"):
                scan_batch(body[:cut])


def header_fields(encoded: bytes) -> list[int]:
    return list(HEADER.unpack_from(encoded, 0))


def with_header(encoded: bytes, **changes: int) -> bytes:
    names = [
        *("ver", "flg", "slen", "ilen", "tcount", "tlen"),
        *("created", "deliver", "times", "res", "plen", "blen"),
    ]
    values = dict(zip(names, header_fields(encoded), strict=True))
    values.update(changes)
    return HEADER.pack(*values.values()) + encoded[HEADER_BYTES:]


TAGGED = Msg(tags=["ab", "c"], body=b"body").encode()


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (with_header(TAGGED, ver=2), r"version 2"),
        (with_header(TAGGED, tcount=0), r"tag block"),
        (with_header(TAGGED, tcount=3), r"ends after 2 of its 3 tags"),
        (with_header(TAGGED, tcount=1), r"does not end where its 1 tags do"),
        # The block is cut inside the second tag; the body's first byte takes its place.
        (with_header(TAGGED, tlen=4, blen=5), r"does not end where its 2 tags do"),
        (with_header(Msg(body=b"x").encode(), tcount=2), r"ends after 0 of its 2 tags"),
        (with_header(TAGGED, blen=5), r"claims \d+ bytes but only \d+ remain"),
        (with_header(TAGGED, plen=0xFFFFFFFF), r"claims"),
        (TAGGED + b"\x01", r"message 1 of the batch has 1 bytes"),
    ],
)
def test_inconsistent_batch_is_remote_protocol_error(data: bytes, text: str) -> None:
    with pytest.raises(RemoteProtocolError, match=text):
        scan_batch(data)


@pytest.mark.parametrize(
    "data",
    [
        with_header(TAGGED, ver=2),
        with_header(TAGGED, tcount=0),
        with_header(TAGGED, tcount=3),
        with_header(TAGGED, tlen=4, blen=5),
        with_header(TAGGED, blen=3),
        with_header(TAGGED, blen=5),
        TAGGED + b"\x00",
        TAGGED[:-1],
        TAGGED[: HEADER_BYTES - 1],
        b"",
    ],
)
def test_inconsistent_message_is_remote_protocol_error_for_decode_message(data: bytes) -> None:
    with pytest.raises(RemoteProtocolError):
        decode_message(data)


def test_decode_message_refuses_a_length_past_the_buffer() -> None:
    data = Msg(body=b"abc").encode()

    with pytest.raises(RemoteProtocolError, match=r"does not lie inside"):
        decode_message(data, 0, len(data) + 1)
    # The header's lengths add up to `length`, but the buffer ends before them.
    with pytest.raises(RemoteProtocolError, match=r"does not lie inside"):
        decode_message(data[:-1], 0, len(data))
    with pytest.raises(RemoteProtocolError, match=r"does not lie inside"):
        decode_message(data, -1, len(data))


def test_decode_message_refuses_names_that_are_not_utf8() -> None:
    data = encode_message(b"\xff\xfe", b"id", b"", 0, b"", b"", 0)

    with pytest.raises(RemoteProtocolError, match=r"UTF-8"):
        decode_message(data)


def test_decode_tags_refuses_a_tag_past_the_block() -> None:
    assert decode_tags(encode_tags(["a", "bc"])) == ["a", "bc"]
    with pytest.raises(RemoteProtocolError, match=r"runs past"):
        decode_tags(b"\x05ab")


@pytest.mark.parametrize("raw", [b"\xc1", b"\x92\x01\x02", b"\x01", b"\x81\x01\x02", b"\x80\x80"])
def test_decode_properties_refuses_what_is_not_a_string_keyed_map(raw: bytes) -> None:
    with pytest.raises(RemoteProtocolError, match=r"properties"):
        decode_properties(raw)


# ---- with_times ----


def test_with_times_changes_only_the_attempt_count() -> None:
    msg = Msg(tags=["t"], props={"k": "v"}, body=b"body", deliver_at_ms=5, times=1)
    encoded = msg.encode()

    changed = with_times(encoded, 7)

    assert len(changed) == len(encoded)
    assert_decodes_to(changed, Msg(tags=["t"], props={"k": "v"}, body=b"body", deliver_at_ms=5, times=7))
    differing = [i for i in range(len(encoded)) if encoded[i] != changed[i]]
    assert differing == [24]  # the low byte of `times`


def test_with_times_can_change_subject_and_due_time() -> None:
    msg = Msg(subject="orders", tags=["t"], props={"k": 1.5}, body=b"body", deliver_at_ms=5)

    changed = with_times(msg.encode(), 3, subject=b"%RETRY%orders%billing", deliver_at_ms=99)

    assert_decodes_to(
        changed,
        Msg(
            subject="%RETRY%orders%billing",
            tags=["t"],
            props={"k": 1.5},
            body=b"body",
            deliver_at_ms=99,
            times=3,
        ),
    )
    assert scan_batch(changed)[0].length == len(changed)


def test_with_times_to_a_shorter_subject() -> None:
    msg = Msg(subject="a-rather-long-subject", message_id="id", body=b"b")

    changed = with_times(msg.encode(), 0, subject=b"s")

    assert_decodes_to(changed, Msg(subject="s", message_id="id", body=b"b"))


@pytest.mark.parametrize("times", [-1, 65536])
def test_with_times_refuses_an_attempt_count_that_does_not_fit(times: int) -> None:
    with pytest.raises(InvalidMessageError, match=rf"attempt count {times} is outside 0..65535"):
        with_times(Msg().encode(), times)


# ---- check_property / check_tag ----


@pytest.mark.parametrize(("key", "value"), ALL_PROPERTY_TYPES.items())
def test_check_property_accepts_every_allowed_type(key: str, value: PropertyValue) -> None:
    check_property(key, value)


@pytest.mark.parametrize(
    ("key", "value", "text"),
    [
        ("", "v", r"non-empty string, got ''"),
        (5, "v", r"non-empty string, got 5"),
        ("k" * 257, "v", r"has 257 characters; the limit is property_key_chars_max 256"),
        ("when", [1], r"property 'when' has a value of type list; use str, int, float, bool or bytes"),
        ("when", None, r"property 'when' has a value of type NoneType"),
        ("big", 2**64, r"property 'big' = 18446744073709551616 does not fit in 64 bits"),
        ("small", -(2**63) - 1, r"property 'small' = -9223372036854775809 does not fit"),
        ("nan", math.nan, r"property 'nan' = nan is not a finite number"),
        ("inf", -math.inf, r"property 'inf' = -inf is not a finite number"),
    ],
)
def test_check_property_names_the_wrong_value(key: object, value: object, text: str) -> None:
    with pytest.raises(InvalidMessageError, match=text):
        check_property(key, value)


def test_check_tag_accepts_up_to_tag_chars_max_bytes() -> None:
    assert check_tag("t" * 64) == "t" * 64
    assert check_tag("é" * 32) == "é" * 32


@pytest.mark.parametrize(
    ("tag", "text"),
    [
        ("", r"non-empty string, got ''"),
        (7, r"non-empty string, got 7"),
        ("t" * 65, r"'t{40}' is 65 bytes of UTF-8; the limit is tag_chars_max 64"),
        ("é" * 33, r"is 66 bytes of UTF-8"),
    ],
)
def test_check_tag_names_the_wrong_value(tag: object, text: str) -> None:
    with pytest.raises(InvalidMessageError, match=text):
        check_tag(tag)


def test_header_layout_is_36_bytes_little_endian() -> None:
    encoded = Msg(subject="s", message_id="i", times=0x0102, body=b"B").encode()

    assert HEADER_BYTES == 36
    assert encoded[:2] == b"\x01\x00"
    assert struct.unpack_from("<H", encoded, 24) == (0x0102,)
    assert encoded[HEADER_BYTES:] == b"siB"


def test_with_times_can_replace_the_properties() -> None:
    from qmq.protocol.message import (
        decode_message,
        decode_properties,
        encode_message,
        encode_properties,
        encode_tags,
        with_times,
    )

    original = encode_message(b"s", b"id", encode_tags(["t"]), 1, encode_properties({"a": 1}), b"body", 5, 0, 0)
    changed = with_times(
        original, 3, subject=b"%RETRY%s%g", properties=encode_properties({"a": 1, "qmq.error": "boom"})
    )
    fields = decode_message(changed)
    assert (fields.subject, fields.message_id, fields.tags, fields.body, fields.times) == (
        "%RETRY%s%g",
        "id",
        ["t"],
        b"body",
        3,
    )
    assert decode_properties(fields.properties_raw) == {"a": 1, "qmq.error": "boom"}
