"""Stored record header: round trip, CRC32C coverage, and what is not a record."""

from __future__ import annotations

import struct

import pytest

from qmq.protocol.record import (
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
    RecordHeader,
    read_record_header,
    record_crc_ok,
    record_header,
)

MESSAGE = bytes(range(256)) + b"payload"


def record(message: bytes = MESSAGE, sequence: int = 41, stored_ms: int = 1_700_000_000_123) -> bytes:
    return record_header(message, sequence, stored_ms) + message


@pytest.mark.parametrize(
    ("message", "sequence", "stored_ms"),
    [(MESSAGE, 41, 1_700_000_000_123), (b"", 0, 0), (b"x", 2**64 - 1, -(2**63)), (b"y" * 5000, 7, 2**63 - 1)],
)
def test_header_round_trip(message: bytes, sequence: int, stored_ms: int) -> None:
    head = record_header(message, sequence, stored_ms)

    got = read_record_header(head + message, 0)

    assert len(head) == RECORD_HEADER_BYTES == 28
    assert got is not None
    assert (got.length, got.sequence, got.stored_ms) == (len(message), sequence, stored_ms)
    assert record_crc_ok(head + message, 0, got)


def test_header_at_an_offset_inside_a_larger_buffer() -> None:
    prefix = record(b"first", 1, 10)
    buf = bytearray(prefix + record(b"second", 2, 20) + b"trailing garbage")

    for view in (buf, memoryview(buf), bytes(buf)):
        got = read_record_header(view, len(prefix))
        assert got is not None
        assert (got.length, got.sequence, got.stored_ms) == (len(b"second"), 2, 20)
        assert record_crc_ok(view, len(prefix), got)


def test_magic_is_qmr1_little_endian() -> None:
    assert record()[:4] == b"QMR1"
    assert struct.unpack_from("<I", record())[0] == RECORD_MAGIC


@pytest.mark.parametrize("xor", [0x01, 0x80, 0xFF])
def test_crc_detects_any_single_flipped_byte_in_the_covered_range(xor: int) -> None:
    good = record()
    covered = range(8, len(good))  # length, sequence, stored_ms and the message

    for i in covered:
        bad = bytearray(good)
        bad[i] ^= xor
        header = read_record_header(bad, 0)
        assert header is not None
        assert not record_crc_ok(bad, 0, header), f"flip of byte {i} went unnoticed"


def test_a_damaged_crc_field_is_noticed_too() -> None:
    bad = bytearray(record())
    bad[5] ^= 0x10

    header = read_record_header(bad, 0)

    assert header is not None
    assert not record_crc_ok(bad, 0, header)


def test_wrong_magic_is_not_a_record() -> None:
    bad = bytearray(record())
    bad[0] ^= 0x01

    assert read_record_header(bad, 0) is None
    assert read_record_header(bytes(RECORD_HEADER_BYTES + 10), 0) is None


@pytest.mark.parametrize("size", [0, 1, RECORD_HEADER_BYTES - 1])
def test_short_buffer_is_not_a_record(size: int) -> None:
    assert read_record_header(record()[:size], 0) is None


def test_header_too_close_to_the_end_is_not_a_record() -> None:
    buf = b"\x00" * 10 + record()

    assert read_record_header(buf, len(buf) - RECORD_HEADER_BYTES + 1) is None


def test_record_cut_before_its_message_ends_fails_the_crc() -> None:
    cut = record()[:-1]

    header = read_record_header(cut, 0)

    assert header is not None
    assert not record_crc_ok(cut, 0, header)


def test_crc_check_with_a_header_claiming_more_than_the_buffer_is_false() -> None:
    buf = record()
    header = read_record_header(buf, 0)
    assert header is not None

    longer = RecordHeader(header.length + 1, header.sequence, header.stored_ms, header.crc)

    assert not record_crc_ok(buf, 0, longer)
