"""Frames: the unit on the wire, and a sans-IO decoder that turns bytes into frames.

Layout of one frame (little-endian)::

    0       4       6   7   8       10      12              16              20
    +-------+-------+---+---+-------+-------+---------------+---------------+--------+------+
    | frame_len     |magic  |ver|flg| code  | status| request_id    | header_len    | header | body |
    +-------+-------+---+---+-------+-------+---------------+---------------+--------+------+

    frame_len   u32  bytes after this field: 16 + header_len + len(body)
    magic       u16  0x514D ("QM")
    ver         u8   protocol version, 1
    flg         u8   bit 0: this frame is a response; other bits must be 0
    code        u16  a RequestCode (a response echoes its request's code)
    status      u16  a Status; 0 in requests
    request_id  u32  chosen by the requester, echoed in the response: many requests in flight
    header_len  u32  length of the header, a msgpack map with string keys (request parameters)
    body             the rest: raw bytes (messages of a send, records of a pull)

The decoder never reads from a socket: feed it with ``receive_data`` and take frames with
``next_frame``. A violation raises ``RemoteProtocolError`` and poisons the decoder; the
connection that fed it must be closed.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass, field
from typing import Any, NoReturn

import msgpack

from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.protocol.errors import LocalProtocolError, RemoteProtocolError
from qmq.protocol.packing import packb

PREFIX = struct.Struct("<IHBBHHII")
PREFIX_BYTES = PREFIX.size  # 20
_AFTER_LEN = PREFIX_BYTES - 4
MAGIC = 0x514D
VERSION = 1
FLAG_RESPONSE = 0x01
_KNOWN_FLAGS = FLAG_RESPONSE
REQUEST_ID_MAX = 0xFFFFFFFF
_U16_MAX = 0xFFFF


@dataclass(slots=True)
class Frame:
    code: int
    request_id: int
    header: dict[str, Any] = field(default_factory=dict)
    body: bytes | bytearray | memoryview = b""
    status: int = 0
    response: bool = False


_EMPTY_HEADER = packb({})


def encode_frame_parts(
    code: int,
    request_id: int,
    header: dict[str, Any] | None,
    body_len: int,
    *,
    status: int = 0,
    response: bool = False,
    limits: Limits = DEFAULT_LIMITS,
) -> bytes:
    """Prefix and header of a frame whose body (``body_len`` bytes) is written after it unchanged.

    Sending the body as a separate buffer (``transport.writelines``) avoids copying large bodies.
    """
    hdr = _EMPTY_HEADER if not header else _pack_header(header)
    if len(hdr) > limits.frame_header_bytes_max:
        raise LocalProtocolError(
            f"frame header of {len(hdr)} bytes exceeds frame_header_bytes_max {limits.frame_header_bytes_max}"
        )
    frame_len = _AFTER_LEN + len(hdr) + body_len
    if frame_len - _AFTER_LEN > limits.frame_bytes_max:
        raise LocalProtocolError(
            f"frame of {frame_len - _AFTER_LEN} bytes exceeds frame_bytes_max {limits.frame_bytes_max}; "
            "send fewer or smaller messages per frame"
        )
    if not 0 <= request_id <= REQUEST_ID_MAX:
        raise LocalProtocolError(f"request id {request_id} is outside 0..{REQUEST_ID_MAX}")
    if not 0 <= code <= _U16_MAX:
        raise LocalProtocolError(f"request code {code} is outside 0..{_U16_MAX}")
    if not 0 <= status <= _U16_MAX:
        raise LocalProtocolError(f"status {status} is outside 0..{_U16_MAX}")
    flags = FLAG_RESPONSE if response else 0
    return PREFIX.pack(frame_len, MAGIC, VERSION, flags, code, status, request_id, len(hdr)) + hdr


def _pack_header(header: dict[str, Any]) -> bytes:
    # The peer refuses a header whose keys are not strings; better to fail here, at the caller.
    for key in header:
        if not isinstance(key, str):
            raise LocalProtocolError(f"frame header key {key!r} is not a string")
    try:
        packed = packb(header)
    except (TypeError, ValueError, OverflowError) as exc:
        raise LocalProtocolError(f"frame header cannot be encoded as msgpack: {exc}") from None
    return packed


def encode_frame(frame: Frame, limits: Limits = DEFAULT_LIMITS) -> bytes:
    """One frame as bytes (copies the body; use ``encode_frame_parts`` for large bodies)."""
    head = encode_frame_parts(
        frame.code,
        frame.request_id,
        frame.header,
        len(frame.body),
        status=frame.status,
        response=frame.response,
        limits=limits,
    )
    return head + bytes(frame.body) if frame.body else head


class FrameDecoder:
    """Bytes in, frames out. Holds at most one partial frame plus what has been fed."""

    __slots__ = ("_broken", "_buf", "_limits", "_pos")

    def __init__(self, limits: Limits = DEFAULT_LIMITS) -> None:
        self._buf = bytearray()
        self._pos = 0
        self._limits = limits
        self._broken: RemoteProtocolError | None = None

    @property
    def buffered_bytes(self) -> int:
        return len(self._buf) - self._pos

    def receive_data(self, data: bytes | bytearray | memoryview) -> None:
        if self._broken is not None:
            raise self._broken
        if self._pos and self._pos * 2 >= len(self._buf):
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_frame(self) -> Frame | None:
        """The next complete frame, or None when more bytes are needed."""
        if self._broken is not None:
            raise self._broken
        buf, pos = self._buf, self._pos
        avail = len(buf) - pos
        if avail < PREFIX_BYTES:
            if avail >= 4:
                self._check_len(int.from_bytes(buf[pos : pos + 4], "little"))
            return None
        frame_len, magic, version, flags, code, status, request_id, header_len = PREFIX.unpack_from(buf, pos)
        self._check_len(frame_len)
        if magic != MAGIC:
            self._fail(
                f"bad magic 0x{magic:04X} (expected 0x{MAGIC:04X}): not a qmq peer, or the stream is out of step"
            )
        if version != VERSION:
            self._fail(f"protocol version {version} is not supported (this side speaks {VERSION})")
        if flags & ~_KNOWN_FLAGS:
            self._fail(f"unknown frame flags 0x{flags:02X}")
        if header_len > self._limits.frame_header_bytes_max:
            self._fail(
                f"frame header of {header_len} bytes exceeds frame_header_bytes_max "
                f"{self._limits.frame_header_bytes_max}"
            )
        if header_len > frame_len - _AFTER_LEN:
            self._fail(
                f"header length {header_len} does not fit the frame "
                f"({frame_len - _AFTER_LEN} bytes after the fixed prefix)"
            )
        end = pos + 4 + frame_len
        if len(buf) < end:
            return None
        hstart = pos + PREFIX_BYTES
        view = memoryview(buf)
        # one copy out of the buffer (slicing the bytearray first would copy twice)
        header = self._decode_header(bytes(view[hstart : hstart + header_len])) if header_len else {}
        body = bytes(view[hstart + header_len : end])
        view.release()  # the bytearray cannot be resized while a view is held
        self._pos = end
        if end == len(buf):
            buf.clear()
            self._pos = 0
        return Frame(code, request_id, header, body, status, bool(flags & FLAG_RESPONSE))

    def _check_len(self, frame_len: int) -> None:
        if frame_len < _AFTER_LEN:
            self._fail(f"frame length {frame_len} is shorter than the {_AFTER_LEN}-byte frame header")
        # The same bound the encoder applies: header and body together within frame_bytes_max.
        if frame_len - _AFTER_LEN > self._limits.frame_bytes_max:
            self._fail(
                f"frame of {frame_len - _AFTER_LEN} bytes exceeds frame_bytes_max "
                f"{self._limits.frame_bytes_max} (send smaller batches)"
            )

    def _decode_header(self, raw: bytes) -> dict[str, Any]:
        try:
            header = msgpack.unpackb(raw, raw=False, strict_map_key=True, use_list=True)
        except Exception as exc:  # msgpack raises many types for bad input; all mean the same here
            self._fail(f"frame header is not valid msgpack: {type(exc).__name__}: {exc}")
        if not isinstance(header, dict):
            self._fail(f"frame header must be a map, got {type(header).__name__}")
        for key in header:
            if not isinstance(key, str):
                self._fail(f"frame header key {key!r:.60} is not a string")
        return header

    def _fail(self, text: str) -> NoReturn:
        self._broken = RemoteProtocolError(text)
        raise self._broken
