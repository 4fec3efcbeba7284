"""Fuzzing the frame decoder: whatever arrives, it yields frames or raises RemoteProtocolError.

Every input is fed twice, whole and one byte at a time; both must give the same frames and
the same error, because a peer chooses how the stream is cut.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from qmq.common.limits import Limits
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.frame import MAGIC, PREFIX, VERSION, Frame, FrameDecoder, encode_frame

# Small limits so that random lengths hit them as well as fit under them.
LIMITS = Limits(frame_bytes_max=2048, frame_header_bytes_max=256)
FUZZ = settings(max_examples=300, deadline=None)

Outcome = tuple[list[Frame], str | None]


def feed(chunks: list[bytes]) -> Outcome:
    decoder = FrameDecoder(LIMITS)
    frames: list[Frame] = []
    try:
        for chunk in chunks:
            decoder.receive_data(chunk)
            while (frame := decoder.next_frame()) is not None:
                frames.append(frame)
    except RemoteProtocolError as exc:
        # A broken decoder must stay broken.
        try:
            decoder.next_frame()
        except RemoteProtocolError:
            pass
        else:
            raise AssertionError("decoder accepted a call after failing") from None
        return frames, str(exc)
    return frames, None


def check_stream(data: bytes) -> Outcome:
    whole = feed([data])
    bytewise = feed([data[i : i + 1] for i in range(len(data))])
    assert whole == bytewise
    return whole


scalars = st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | st.text(max_size=8) | st.binary(max_size=8)
header_values = scalars | st.lists(scalars, max_size=3) | st.dictionaries(st.text(max_size=4), scalars, max_size=2)
frames = st.builds(
    Frame,
    code=st.integers(0, 0xFFFF),
    request_id=st.integers(0, 0xFFFFFFFF),
    header=st.dictionaries(st.text(max_size=6), header_values, max_size=3),
    body=st.binary(max_size=100),
    status=st.integers(0, 0xFFFF),
    response=st.booleans(),
)


@st.composite
def mutated_streams(draw: st.DrawFn) -> bytes:
    sent = draw(st.lists(frames, min_size=1, max_size=3))
    data = bytearray(b"".join(encode_frame(f, LIMITS) for f in sent))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "set", "cut", "insert", "delete"]))
        i = draw(st.integers(0, max(len(data) - 1, 0)))
        if not data:
            break
        if kind == "flip":
            data[i] ^= 1 << draw(st.integers(0, 7))
        elif kind == "set":
            data[i] = draw(st.integers(0, 255))
        elif kind == "cut":
            del data[i:]
        elif kind == "insert":
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        else:
            del data[i : i + draw(st.integers(1, 8))]
    return bytes(data)


@st.composite
def plausible_prefixes(draw: st.DrawFn) -> bytes:
    """A prefix that passes the first checks more often than random bytes do, then garbage."""
    tail = draw(st.binary(max_size=200))
    frame_len = draw(st.one_of(st.just(16 + len(tail)), st.integers(0, 3000)))
    header_len = draw(st.one_of(st.integers(0, len(tail)), st.integers(0, 400)))
    magic = draw(st.one_of(st.just(MAGIC), st.integers(0, 0xFFFF)))
    version = draw(st.one_of(st.just(VERSION), st.integers(0, 255)))
    flags = draw(st.integers(0, 3))
    return PREFIX.pack(frame_len, magic, version, flags, 1, 0, 1, header_len) + tail


@FUZZ
@given(st.binary(max_size=600))
def test_arbitrary_bytes_yield_frames_or_remote_protocol_error(data: bytes) -> None:
    check_stream(data)


@FUZZ
@given(mutated_streams())
def test_mutated_frames_yield_frames_or_remote_protocol_error(data: bytes) -> None:
    check_stream(data)


@FUZZ
@given(plausible_prefixes())
def test_plausible_prefixes_yield_frames_or_remote_protocol_error(data: bytes) -> None:
    check_stream(data)


@FUZZ
@given(st.lists(frames, max_size=4))
def test_valid_streams_decode_to_what_was_encoded(sent: list[Frame]) -> None:
    got, error = check_stream(b"".join(encode_frame(f, LIMITS) for f in sent))

    assert error is None
    assert got == sent


def test_outcome_compares_frames_and_error_text() -> None:
    # Guards the harness itself: a bad frame after a good one shows up as (frames, error).
    good: dict[str, Any] = {"k": 1}
    data = encode_frame(Frame(1, 1, good), LIMITS) + b"\x00" * 20

    got, error = check_stream(data)

    assert got == [Frame(1, 1, good)]
    assert error is not None
    assert "shorter" in error
