"""Fuzzing the message codec: the broker scans and the consumer decodes bytes from a peer, so
either they succeed or they raise RemoteProtocolError — never IndexError, struct.error or
UnicodeDecodeError.
"""

from __future__ import annotations

import contextlib

from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.common.limits import Limits
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import (
    HEADER,
    VERSION,
    decode_message,
    decode_properties,
    encode_message,
    encode_properties,
    encode_tags,
    scan_batch,
)

FUZZ = settings(max_examples=300, deadline=None)
LIMITS = Limits(batch_messages_max=20)


def scan_and_decode(data: bytes) -> None:
    """Scan ``data`` as a batch; every message it finds must then decode on its own."""
    try:
        scanned = scan_batch(data, LIMITS)
    except RemoteProtocolError:
        scanned = []
    for s in scanned:
        try:
            fields = decode_message(data, s.pos, s.length)
        except RemoteProtocolError:
            continue  # e.g. a subject that is not UTF-8: the broker checks that per message
        assert fields.subject.encode() == s.subject
        with contextlib.suppress(RemoteProtocolError):
            decode_properties(fields.properties_raw)
    with contextlib.suppress(RemoteProtocolError):
        decode_message(data)


property_values = st.integers(-(2**63), 2**64 - 1) | st.text(max_size=3) | st.binary(max_size=3)


@st.composite
def encoded_messages(draw: st.DrawFn) -> bytes:
    tags = draw(st.lists(st.text(min_size=1, max_size=4), max_size=3))
    return encode_message(
        draw(st.text(min_size=1, max_size=10)).encode(),
        draw(st.text(max_size=10)).encode(),
        encode_tags(tags),
        len(tags),
        encode_properties(draw(st.dictionaries(st.text(max_size=3), property_values, max_size=2))),
        draw(st.binary(max_size=20)),
        draw(st.integers(-(2**63), 2**63 - 1)),
    )


@st.composite
def mutated_batches(draw: st.DrawFn) -> bytes:
    data = bytearray(b"".join(draw(st.lists(encoded_messages(), min_size=1, max_size=4))))
    for _ in range(draw(st.integers(1, 4))):
        if not data:
            break
        i = draw(st.integers(0, len(data) - 1))
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert"]))
        if kind == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[i:]
        else:
            data[i:i] = draw(st.binary(min_size=1, max_size=6))
    return bytes(data)


@st.composite
def plausible_headers(draw: st.DrawFn) -> bytes:
    """A version-1 header with small random lengths followed by random bytes."""
    small = st.integers(0, 12)
    header = HEADER.pack(
        VERSION,
        0,
        draw(small),
        draw(small),
        draw(st.integers(0, 4)),
        draw(small),
        0,
        0,
        0,
        0,
        draw(small),
        draw(small),
    )
    return header + draw(st.binary(max_size=60))


@FUZZ
@given(st.binary(max_size=400))
def test_arbitrary_bytes_scan_or_raise_remote_protocol_error(data: bytes) -> None:
    scan_and_decode(data)


@FUZZ
@given(mutated_batches())
def test_mutated_batches_scan_or_raise_remote_protocol_error(data: bytes) -> None:
    scan_and_decode(data)


@FUZZ
@given(plausible_headers())
def test_plausible_headers_scan_or_raise_remote_protocol_error(data: bytes) -> None:
    scan_and_decode(data)


@FUZZ
@given(st.binary(max_size=100))
def test_arbitrary_properties_decode_or_raise_remote_protocol_error(data: bytes) -> None:
    try:
        props = decode_properties(data)
    except RemoteProtocolError:
        return
    assert isinstance(props, dict)
