"""Frame codec: round trips, chunking of the stream, limits and every kind of malformed frame."""

from __future__ import annotations

import random
import struct
from collections.abc import Iterable, Iterator
from typing import Any

import msgpack
import pytest

from qmq.common.limits import Limits
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import LocalProtocolError, RemoteProtocolError
from qmq.protocol.frame import (
    MAGIC,
    PREFIX,
    PREFIX_BYTES,
    REQUEST_ID_MAX,
    VERSION,
    Frame,
    FrameDecoder,
    encode_frame,
    encode_frame_parts,
)

SMALL = Limits(frame_bytes_max=1024, frame_header_bytes_max=128)
AFTER_LEN = PREFIX_BYTES - 4

RICH_HEADER: dict[str, Any] = {
    "subject": "orders.créées",
    "max": 100,
    "negative": -7,
    "ratio": 0.25,
    "flag": True,
    "nothing": None,
    "ranges": [[0, 5], [9, 12]],
    "nested": {"a": b"\x00\xff", "b": ""},
}


def sample_frames() -> list[Frame]:
    frames: list[Frame] = []
    for response in (False, True):
        for header in ({}, {"k": "v"}, RICH_HEADER):
            for body in (b"", b"x", bytes(range(256)) * 40):
                frames.append(
                    Frame(
                        code=RequestCode.PULL,
                        request_id=len(frames) + 1,
                        header=dict(header),
                        body=body,
                        status=Status.BUSY if response else 0,
                        response=response,
                    )
                )
    return frames


def drain(decoder: FrameDecoder) -> Iterator[Frame]:
    while (frame := decoder.next_frame()) is not None:
        yield frame


def decode_chunks(chunks: Iterable[bytes], limits: Limits = SMALL) -> list[Frame]:
    decoder = FrameDecoder(limits)
    out: list[Frame] = []
    for chunk in chunks:
        decoder.receive_data(chunk)
        out.extend(drain(decoder))
    assert decoder.buffered_bytes == 0
    return out


def random_chunks(data: bytes, seed: int) -> list[bytes]:
    rng = random.Random(seed)
    chunks = []
    pos = 0
    while pos < len(data):
        n = rng.randint(1, 64)
        chunks.append(data[pos : pos + n])
        pos += n
    return chunks


def raw_frame(
    *,
    magic: int = MAGIC,
    version: int = VERSION,
    flags: int = 0,
    header: bytes = b"\x80",
    header_len: int | None = None,
    body: bytes = b"",
    frame_len: int | None = None,
) -> bytes:
    """A frame built by hand, so that any field can be wrong."""
    hlen = len(header) if header_len is None else header_len
    flen = AFTER_LEN + len(header) + len(body) if frame_len is None else frame_len
    return PREFIX.pack(flen, magic, version, flags, RequestCode.PING, 0, 7, hlen) + header + body


def decode_one(data: bytes, limits: Limits = SMALL) -> Frame | None:
    decoder = FrameDecoder(limits)
    decoder.receive_data(data)
    return decoder.next_frame()


LARGE = Limits(frame_bytes_max=1 << 20, frame_header_bytes_max=1 << 16)


@pytest.mark.parametrize("frame", sample_frames(), ids=lambda f: f"id{f.request_id}")
def test_round_trip_keeps_every_field(frame: Frame) -> None:
    data = encode_frame(frame, LARGE)

    decoded = decode_one(data, LARGE)

    assert decoded == frame
    assert decoded is not None
    assert isinstance(decoded.body, bytes)


def test_request_and_response_keep_their_own_flag_status_and_code() -> None:
    request = Frame(RequestCode.SEND_MESSAGES, 42, {"a": 1}, b"body")
    response = Frame(RequestCode.SEND_MESSAGES, 42, {"error": "x"}, b"", status=Status.DISK_FULL, response=True)

    frames = decode_chunks([encode_frame(request) + encode_frame(response)], LARGE)

    assert frames == [request, response]
    assert (frames[0].response, frames[1].response) == (False, True)
    assert frames[1].status == Status.DISK_FULL


@pytest.mark.parametrize("request_id", [0, 1, REQUEST_ID_MAX])
def test_request_id_extremes_round_trip(request_id: int) -> None:
    frame = Frame(RequestCode.ACK, request_id)

    assert decode_one(encode_frame(frame)) == frame


def test_encode_frame_parts_plus_body_equals_encode_frame() -> None:
    body = b"\x01\x02" * 100
    head = encode_frame_parts(RequestCode.PULL, 9, {"x": 1}, len(body), status=3, response=True)

    assert head + body == encode_frame(Frame(RequestCode.PULL, 9, {"x": 1}, body, 3, True))


def test_body_may_be_bytearray_or_memoryview() -> None:
    for body in (bytearray(b"abc"), memoryview(b"abc")):
        decoded = decode_one(encode_frame(Frame(RequestCode.PING, 1, {}, body)))
        assert decoded is not None
        assert decoded.body == b"abc"


def test_stream_whole_bytewise_and_random_chunks_give_the_same_frames() -> None:
    frames = sample_frames()
    data = b"".join(encode_frame(f, LARGE) for f in frames)

    whole = decode_chunks([data], LARGE)
    bytewise = decode_chunks((data[i : i + 1] for i in range(len(data))), LARGE)
    chunked = [decode_chunks(random_chunks(data, seed), LARGE) for seed in range(5)]

    assert whole == frames
    assert bytewise == frames
    assert all(c == frames for c in chunked)


def test_several_frames_in_one_chunk_come_out_one_by_one() -> None:
    frames = [Frame(RequestCode.PING, i, {"i": i}, b"b" * i) for i in range(3)]
    decoder = FrameDecoder()
    decoder.receive_data(b"".join(encode_frame(f) for f in frames))

    assert [decoder.next_frame() for _ in range(4)] == [*frames, None]
    assert decoder.buffered_bytes == 0


def test_partial_frame_waits_for_more_bytes() -> None:
    data = encode_frame(Frame(RequestCode.PING, 1, {"a": 1}, b"body"))
    decoder = FrameDecoder()

    decoder.receive_data(data[:-1])

    assert decoder.next_frame() is None
    assert decoder.buffered_bytes == len(data) - 1
    decoder.receive_data(data[-1:])
    assert decoder.next_frame() == Frame(RequestCode.PING, 1, {"a": 1}, b"body")


def test_zero_header_length_decodes_as_empty_header() -> None:
    frame = decode_one(raw_frame(header=b"", body=b"xyz"))

    assert frame is not None
    assert (frame.header, frame.body) == ({}, b"xyz")


# ---- limits ----


def test_encode_accepts_header_and_body_exactly_at_frame_bytes_max() -> None:
    header = {"k": "v"}
    body = b"x" * (SMALL.frame_bytes_max - len(msgpack.packb(header)))

    data = encode_frame(Frame(RequestCode.PING, 1, header, body), SMALL)

    assert decode_one(data, SMALL) == Frame(RequestCode.PING, 1, header, body)


def test_encode_refuses_frame_over_frame_bytes_max() -> None:
    with pytest.raises(LocalProtocolError, match=r"frame_bytes_max 1024"):
        encode_frame(Frame(RequestCode.PING, 1, {}, b"x" * SMALL.frame_bytes_max), SMALL)


def test_encode_refuses_header_over_frame_header_bytes_max() -> None:
    with pytest.raises(LocalProtocolError, match=r"frame_header_bytes_max 128"):
        encode_frame(Frame(RequestCode.PING, 1, {"k": "v" * 200}), SMALL)


def test_decode_refuses_frame_over_frame_bytes_max_from_its_length_prefix() -> None:
    data = encode_frame(Frame(RequestCode.PING, 1, {}, b"x" * SMALL.frame_bytes_max), LARGE)
    decoder = FrameDecoder(SMALL)

    # Only the length prefix has arrived: the frame is refused before its body is buffered.
    decoder.receive_data(data[:4])

    with pytest.raises(RemoteProtocolError, match=r"frame_bytes_max 1024"):
        decoder.next_frame()


def test_decode_refuses_huge_length_prefix_at_once() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack("<I", 0xFFFFFFFF))

    with pytest.raises(RemoteProtocolError, match=r"frame_bytes_max"):
        decoder.next_frame()


def test_decode_refuses_header_over_frame_header_bytes_max() -> None:
    data = encode_frame(Frame(RequestCode.PING, 1, {"k": "v" * 200}), LARGE)

    with pytest.raises(RemoteProtocolError, match=r"frame_header_bytes_max 128"):
        decode_one(data, SMALL)


def test_decode_refuses_oversized_header_length_before_the_header_arrives() -> None:
    data = raw_frame(header=b"\x80" * 200)
    decoder = FrameDecoder(SMALL)
    decoder.receive_data(data[:PREFIX_BYTES])

    with pytest.raises(RemoteProtocolError, match=r"frame_header_bytes_max"):
        decoder.next_frame()


# ---- malformed frames ----


@pytest.mark.parametrize(
    ("data", "text"),
    [
        (raw_frame(magic=0x4D51), r"bad magic 0x4D51"),
        (raw_frame(version=2), r"version 2"),
        (raw_frame(flags=0x02), r"unknown frame flags 0x02"),
        (raw_frame(flags=0x81), r"unknown frame flags 0x81"),
        (raw_frame(header=b"\xc1"), r"not valid msgpack"),
        (raw_frame(header=b"\x92\x01"), r"not valid msgpack"),
        (raw_frame(header=b"\x80\x80"), r"not valid msgpack"),
        (raw_frame(header=msgpack.packb([1, 2])), r"must be a map, got list"),
        (raw_frame(header=msgpack.packb("text")), r"must be a map, got str"),
        (raw_frame(header=msgpack.packb({1: 2})), r"not valid msgpack"),
        (raw_frame(header=msgpack.packb({b"k": 2})), r"key b'k' is not a string"),
        (raw_frame(header=b"\x80", header_len=50), r"header length 50 does not fit the frame"),
        (raw_frame(frame_len=AFTER_LEN - 1), r"frame length 15 is shorter"),
        (raw_frame(frame_len=0), r"frame length 0 is shorter"),
    ],
)
def test_malformed_frame_is_remote_protocol_error(data: bytes, text: str) -> None:
    with pytest.raises(RemoteProtocolError, match=text):
        decode_one(data)


def test_short_length_is_refused_when_its_four_bytes_arrive() -> None:
    decoder = FrameDecoder()
    decoder.receive_data(struct.pack("<I", 3))

    with pytest.raises(RemoteProtocolError, match=r"shorter"):
        decoder.next_frame()


def test_decoder_stays_broken_after_an_error() -> None:
    good = encode_frame(Frame(RequestCode.PING, 1))
    decoder = FrameDecoder()
    decoder.receive_data(raw_frame(magic=0))
    with pytest.raises(RemoteProtocolError) as first:
        decoder.next_frame()

    with pytest.raises(RemoteProtocolError) as again:
        decoder.next_frame()
    with pytest.raises(RemoteProtocolError):
        decoder.receive_data(good)
    assert str(again.value) == str(first.value)


def test_frames_before_a_bad_one_are_delivered_first() -> None:
    good = encode_frame(Frame(RequestCode.PING, 1))
    decoder = FrameDecoder()
    decoder.receive_data(good + raw_frame(version=9))

    assert decoder.next_frame() == Frame(RequestCode.PING, 1)
    with pytest.raises(RemoteProtocolError, match="version 9"):
        decoder.next_frame()


# ---- encoder refusals ----


@pytest.mark.parametrize(
    ("kwargs", "text"),
    [
        ({"request_id": -1}, r"request id -1"),
        ({"request_id": REQUEST_ID_MAX + 1}, r"request id 4294967296"),
        ({"code": 0x10000}, r"request code 65536"),
        ({"code": -1}, r"request code -1"),
        ({"status": 0x10000}, r"status 65536"),
        ({"header": {1: "int key"}}, r"header key 1 is not a string"),
        ({"header": {"k": object()}}, r"cannot be encoded as msgpack"),
        ({"header": {"k": 2**64}}, r"cannot be encoded as msgpack"),
    ],
)
def test_encoder_refuses_what_the_protocol_cannot_carry(kwargs: dict[str, Any], text: str) -> None:
    args: dict[str, Any] = {"code": RequestCode.PING, "request_id": 1, "header": {}, "status": 0}
    args.update(kwargs)

    with pytest.raises(LocalProtocolError, match=text):
        encode_frame_parts(args["code"], args["request_id"], args["header"], 0, status=args["status"])
