"""A stored record: the broker's frame around a message in its message log.

Pulls send records to consumers exactly as stored, so this layout is part of the wire
protocol too. Layout (little-endian)::

    0         4         8         12                  20                  28
    +---------+---------+---------+-------------------+-------------------+-----------------+
    | magic   | crc32c  | length  | sequence          | stored_ms         | message (length)|
    +---------+---------+---------+-------------------+-------------------+-----------------+

    magic      u32  0x31524D51 ("QMR1")
    crc32c     u32  CRC32C of bytes 8 .. 28+length (length, sequence, stored_ms, message)
    length     u32  bytes of the encoded message (see qmq.protocol.message)
    sequence   u64  the message's place in its subject's consume log
    stored_ms  i64  when the broker stored it (epoch ms)
"""

from __future__ import annotations

import struct
from typing import NamedTuple

import crc32c

from qmq.protocol.message import HEADER

RECORD_HEADER = struct.Struct("<IIIQq")
RECORD_HEADER_BYTES = RECORD_HEADER.size  # 28
RECORD_MAGIC = 0x31524D51
# A record's header and the header of the message in it, read with one unpack (a reader that
# walks records: the SDK's pull parser, recovery's pass over the duplicate window).
RECORD_AND_MESSAGE_HEADERS = struct.Struct("<" + RECORD_HEADER.format.lstrip("<") + HEADER.format.lstrip("<"))
_TAIL = struct.Struct("<IQq")
_CRC = RECORD_CRC = struct.Struct("<I")  # the crc32c field, packed in place once the rest is written


def record_header(message: bytes | memoryview, sequence: int, stored_ms: int) -> bytes:
    """The 28-byte header that precedes ``message`` in the log."""
    tail = _TAIL.pack(len(message), sequence, stored_ms)
    crc = crc32c.crc32c(message, crc32c.crc32c(tail))
    return struct.pack("<II", RECORD_MAGIC, crc) + tail


def pack_record_into(buf: bytearray, pos: int, message: bytes | memoryview, sequence: int, stored_ms: int) -> int:
    """Write header and message at ``buf[pos:]`` (which must have room); return the end position.

    One copy of the message and one CRC pass over the covered bytes, in place.
    """
    end = pos + RECORD_HEADER_BYTES + len(message)
    buf[pos + RECORD_HEADER_BYTES : end] = message
    RECORD_HEADER.pack_into(buf, pos, RECORD_MAGIC, 0, len(message), sequence, stored_ms)
    _CRC.pack_into(buf, pos + 4, crc32c.crc32c(memoryview(buf)[pos + 8 : end]))
    return end


class RecordHeader(NamedTuple):
    length: int
    sequence: int
    stored_ms: int
    crc: int


def read_record_header(buf: bytes | bytearray | memoryview, pos: int) -> RecordHeader | None:
    """The header at ``pos``, or None if the magic is wrong or too few bytes remain."""
    if len(buf) - pos < RECORD_HEADER_BYTES:
        return None
    magic, crc, length, sequence, stored_ms = RECORD_HEADER.unpack_from(buf, pos)
    if magic != RECORD_MAGIC:
        return None
    return RecordHeader(length, sequence, stored_ms, crc)


def record_crc_ok(buf: bytes | bytearray | memoryview, pos: int, header: RecordHeader) -> bool:
    start = pos + 8
    end = pos + RECORD_HEADER_BYTES + header.length
    if end > len(buf):
        return False
    return crc32c.crc32c(memoryview(buf)[start:end]) == header.crc
