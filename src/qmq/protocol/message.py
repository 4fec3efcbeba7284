"""The message codec: how a producer encodes a message and what the broker reads of it.

The broker stores the bytes a producer sent unchanged and reads only the fixed header and
the names after it (subject, id, tags), so it never decodes properties or bodies.

Layout of one encoded message (little-endian)::

    0    1    2         4    5    6         8                 16
    +----+----+---------+----+----+---------+-----------------+
    |ver |flg |subj_len |id_l|tags|tags_len | created_ms      |
    +----+----+---------+----+----+---------+-----------------+
    16                24        26        28        32        36
    +-----------------+---------+---------+---------+---------+
    | deliver_at_ms   | times   |slot/copy|props_len|body_len |
    +-----------------+---------+---------+---------+---------+
    then: subject (utf-8) | message id (utf-8) | tags (each: u8 length + utf-8)
          | properties (msgpack map) | body

    ver            u8   1
    flg            u8   flags: FLAG_REPEAT (0x01) asks a delay server to deliver copies of the
                        message (properties REPEAT_EVERY_MS and REPEAT_TIMES say how); FLAG_CANCEL
                        (0x02) marks a cancel in a delay server's write-ahead log, never sent;
                        FLAG_ORDERED (0x04) says slot/copy holds an order slot; other bits 0
    subj_len       u16  bytes of the subject
    id_l           u8   bytes of the message id
    tags           u8   number of tags
    tags_len       u16  bytes of the tag block
    created_ms     i64  when the producer made the message (epoch ms)
    deliver_at_ms  i64  when it is due (epoch ms); 0 = now
    times          u16  the delivery attempt this copy is for: 1 for a first send, n + 1 for the
                        copy made after n failed attempts (0, written by qmq before 0.2, reads as 1)
    slot/copy      u16  with FLAG_ORDERED: the message's order-key slot + 1 (qmq.common.ordering).
                        Otherwise the copy of a repeating delay message (1..REPEAT_COPIES_MAX,
                        also in the property REPEAT_COPY), 0 for any other message. Every
                        message of qmq before 0.3 has 0 here and no flag (the field was
                        reserved). An ordered message is never delayed, so never repeated: the
                        two uses never meet in one message. Part of what makes a message a
                        repeat in a broker's duplicate window (copies share an id; a key's
                        messages always have the same slot)
    props_len      u32  bytes of the msgpack-encoded properties (0 = none)
    body_len       u32  bytes of the body
"""

from __future__ import annotations

import math
import struct
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import msgpack

from qmq.common.errors import InvalidMessageError
from qmq.common.limits import DEFAULT_LIMITS, Limits
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.packing import packb

HEADER = struct.Struct("<BBHBBHqqHHII")
HEADER_BYTES = HEADER.size  # 36
VERSION = 1
TIMES_MAX = 0xFFFF
FLAGS_POS = 1  # of flg in the header
FLAG_REPEAT = 0x01
FLAG_CANCEL = 0x02
FLAG_ORDERED = 0x04
COPY_POS = 26  # of slot/copy in the header

# Properties of a repeating delay message (FLAG_REPEAT): set by the SDK, read by the delay
# server, which writes REPEAT_COPY into each copy it makes; consumers see all three.
REPEAT_EVERY_PROPERTY = "qmq.repeat.every_ms"
REPEAT_TIMES_PROPERTY = "qmq.repeat.times"
REPEAT_COPY_PROPERTY = "qmq.repeat.copy"
ORDER_SLOT = struct.Struct("<H")
ORDER_SLOT_POS = COPY_POS  # read only with FLAG_ORDERED (see the layout above)


def order_slot_field(message: bytes | bytearray | memoryview, pos: int = 0) -> int:
    """The slot/copy field of the encoded message at ``pos`` when it holds an order slot
    (FLAG_ORDERED): the slot + 1; 0 for a message without an order key (a repeat's copy too)."""
    if not message[pos + FLAGS_POS] & FLAG_ORDERED:
        return 0
    return int(message[pos + ORDER_SLOT_POS]) | int(message[pos + ORDER_SLOT_POS + 1]) << 8

PropertyValue = str | int | float | bool | bytes


def encode_properties(props: Mapping[str, PropertyValue]) -> bytes:
    return packb(props) if props else b""


def decode_properties(raw: bytes | memoryview) -> dict[str, PropertyValue]:
    if not raw:
        return {}
    try:
        props = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as exc:  # msgpack raises many types for bad input
        raise RemoteProtocolError(f"message properties are not valid msgpack: {exc}") from None
    if not isinstance(props, dict):
        raise RemoteProtocolError(f"message properties must be a map, got {type(props).__name__}")
    return props


def check_property(key: object, value: object, limits: Limits = DEFAULT_LIMITS) -> None:
    """Raise InvalidMessageError unless (key, value) is a property qmq can carry."""
    if not isinstance(key, str) or not key:
        raise InvalidMessageError(f"property name must be a non-empty string, got {key!r}")
    if len(key) > limits.property_key_chars_max:
        raise InvalidMessageError(
            f"property name {key[:40]!r}… has {len(key)} characters; "
            f"the limit is property_key_chars_max {limits.property_key_chars_max}"
        )
    if not isinstance(value, str | int | float | bool | bytes):
        raise InvalidMessageError(
            f"property {key!r} has a value of type {type(value).__name__}; use str, int, float, bool or bytes"
        )
    if isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        raise InvalidMessageError(f"property {key!r} = {value} does not fit in 64 bits")
    if isinstance(value, float) and not math.isfinite(value):
        raise InvalidMessageError(f"property {key!r} = {value} is not a finite number")
    check_utf8("property name", key)
    if isinstance(value, str):
        check_utf8(f"property {key!r}", value)


def check_utf8(what: str, text: str) -> None:
    """InvalidMessageError naming ``what`` when ``text`` holds a lone surrogate UTF-8 cannot carry."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise InvalidMessageError(
                f"{what} holds {text[exc.start]!r} at position {exc.start}, a lone surrogate that UTF-8 "
                "cannot carry; decode bytes with a real encoding (or with errors='replace') first"
            ) from None


def check_tag(tag: object, limits: Limits = DEFAULT_LIMITS) -> str:
    if not isinstance(tag, str) or not tag:
        raise InvalidMessageError(f"a tag must be a non-empty string, got {tag!r}")
    check_utf8("tag", tag)
    tag_bytes = len(tag.encode("utf-8"))
    if tag_bytes > limits.tag_chars_max:
        raise InvalidMessageError(
            f"tag {tag[:40]!r} is {tag_bytes} bytes of UTF-8; the limit is tag_chars_max "
            f"{limits.tag_chars_max}: use a shorter tag"
        )
    return tag


def encode_tags(tags: Iterable[str]) -> bytes:
    out = bytearray()
    for tag in tags:
        raw = tag.encode("utf-8")
        out.append(len(raw))
        out += raw
    return bytes(out)


def decode_tags(raw: bytes | memoryview) -> list[str]:
    """The tags of a tag block; RemoteProtocolError if a tag runs past the block's end."""
    tags: list[str] = []
    pos = 0
    end = len(raw)
    while pos < end:  # bounded: every step moves pos forward by at least one byte
        n = raw[pos]
        if pos + 1 + n > end:
            raise RemoteProtocolError(f"tag {len(tags)} of {n} bytes runs past the end of the tag block")
        tags.append(bytes(raw[pos + 1 : pos + 1 + n]).decode("utf-8"))
        pos += 1 + n
    return tags


def _tag_block_problem(buf: bytes, start: int, end: int, count: int) -> str | None:
    """Why ``buf[start:end]`` is not a block of exactly ``count`` tags, or None if it is one."""
    pos = start
    for i in range(count):
        if pos >= end:
            return f"tag block of {end - start} bytes ends after {i} of its {count} tags"
        pos += 1 + buf[pos]
    if pos != end:
        return f"tag block of {end - start} bytes does not end where its {count} tags do"
    return None


def encode_message(
    subject: bytes,
    message_id: bytes,
    tags: bytes,
    tag_count: int,
    props: bytes,
    body: bytes,
    created_ms: int,
    deliver_at_ms: int = 0,
    times: int = 1,
    order_slot: int = 0,
) -> bytes:
    """Encode one message; arguments are already encoded (see ``encode_tags``, ``encode_properties``).
    ``order_slot`` is the order key's slot + 1, or 0 without an order key."""
    return b"".join(
        (
            HEADER.pack(
                VERSION,
                FLAG_ORDERED if order_slot else 0,
                len(subject),
                len(message_id),
                tag_count,
                len(tags),
                created_ms,
                deliver_at_ms,
                times,
                order_slot,
                len(props),
                len(body),
            ),
            subject,
            message_id,
            tags,
            props,
            body,
        )
    )


class MessageFields(NamedTuple):
    """Every field of one encoded message; byte fields are slices of the buffer it came from."""

    subject: str
    message_id: str
    tags: list[str]
    properties_raw: bytes
    body: bytes
    created_ms: int
    deliver_at_ms: int
    times: int


def decode_message(buf: bytes, pos: int = 0, length: int | None = None) -> MessageFields:
    """Decode the message at ``buf[pos:]``; raise RemoteProtocolError if it is malformed."""
    end = len(buf) if length is None else pos + length
    if pos < 0 or end > len(buf):
        raise RemoteProtocolError(f"message at {pos}..{end} does not lie inside the {len(buf)}-byte buffer")
    if end - pos < HEADER_BYTES:
        raise RemoteProtocolError(f"message of {end - pos} bytes is shorter than its {HEADER_BYTES}-byte header")
    ver, _flags, slen, ilen, tcount, tlen, created, deliver, times, _res, plen, blen = HEADER.unpack_from(buf, pos)
    if ver != VERSION:
        raise RemoteProtocolError(f"message version {ver} is not supported")
    p = pos + HEADER_BYTES
    if p + slen + ilen + tlen + plen + blen != end:
        raise RemoteProtocolError("message field lengths do not add up to the message length")
    problem = _tag_block_problem(buf, p + slen + ilen, p + slen + ilen + tlen, tcount)
    if problem:
        raise RemoteProtocolError(f"message {problem}")
    try:
        subject = buf[p : p + slen].decode("utf-8")
        p += slen
        message_id = buf[p : p + ilen].decode("utf-8")
        p += ilen
        tags = decode_tags(buf[p : p + tlen]) if tlen else []
    except UnicodeDecodeError as exc:
        raise RemoteProtocolError(f"message names are not valid UTF-8: {exc}") from None
    p += tlen
    props = buf[p : p + plen]
    p += plen
    return MessageFields(subject, message_id, tags, props, buf[p : p + blen], created, deliver, times)


class ScannedMessage(NamedTuple):
    """What the broker reads of a message in a send batch, without decoding it."""

    pos: int
    length: int
    subject: bytes
    message_id: bytes
    tags: bytes  # the raw tag block, b"" without tags
    deliver_at_ms: int
    times: int  # delivery attempt: a retry of a message is a new message with the same id
    copy: int  # copy of a repeating delay message (0: not one): copies share their id


def scan_batch(
    body: bytes, limits: Limits = DEFAULT_LIMITS, problems: dict[int, str] | None = None
) -> list[ScannedMessage]:
    """Split a send frame's body into its messages.

    Raises RemoteProtocolError when the batch cannot be split (lengths that do not add up):
    the frame is malformed and nothing of it can be trusted. With ``problems`` (a send), it
    also checks what consumers will decode — see ``message_problem`` — and fills
    ``problems`` with the index and reason of each message to refuse; subject and size are
    the store's checks, message by message.
    """
    out: list[ScannedMessage] = []
    append = out.append
    new_tuple = tuple.__new__
    unpack = HEADER.unpack_from
    hb = HEADER_BYTES
    pos = 0
    end = len(body)
    count_max = limits.batch_messages_max
    checking = problems is not None
    attempts_max = limits.attempts_max
    texts: list[bytes] = []  # ids and tag blocks, decoded together once
    props_at: list[int] = []  # [start, end, ...] of each property block
    suspect = False
    while pos < end:
        if end - pos < hb:
            raise RemoteProtocolError(
                f"message {len(out)} of the batch has {end - pos} bytes, fewer than its {hb}-byte header"
            )
        ver, _flags, slen, ilen, tcount, tlen, _created, deliver, times, copy, plen, blen = unpack(body, pos)
        if ver != VERSION:
            raise RemoteProtocolError(f"message {len(out)} of the batch has version {ver}; this broker reads {VERSION}")
        p = pos + hb
        length = hb + slen + ilen + tlen + plen + blen
        if pos + length > end:
            raise RemoteProtocolError(
                f"message {len(out)} of the batch claims {length} bytes but only {end - pos} remain"
            )
        tstart = p + slen + ilen
        if tcount or tlen:
            problem = _tag_block_problem(body, tstart, tstart + tlen, tcount)
            if problem:
                raise RemoteProtocolError(f"message {len(out)} of the batch: {problem}")
        message_id = body[p + slen : tstart]
        tags = body[tstart : tstart + tlen] if tlen else b""
        # tuple.__new__ skips NamedTuple's Python-level __new__: a quarter of the cost per message
        append(new_tuple(ScannedMessage, (pos, length, body[p : p + slen], message_id, tags, deliver, times, copy)))
        if checking:
            texts.append(message_id)
            if tlen:
                texts.append(tags)
            if times > attempts_max:
                suspect = True
            if plen:
                props_at.append(tstart + tlen)
                props_at.append(tstart + tlen + plen)
        if len(out) > count_max:
            raise RemoteProtocolError(f"batch has more than batch_messages_max {count_max} messages")
        pos += length
    if checking and (suspect or not _texts_ok(texts) or not _property_blocks_ok(body, props_at)):
        assert problems is not None
        for i, sm in enumerate(out):
            problem = message_problem(body, sm, limits)
            if problem is not None:
                problems[i] = problem
    return out


def _texts_ok(texts: list[bytes]) -> bool:
    # One decode for the whole batch: the newline separators and the tag lengths (< 128) are
    # ASCII, never UTF-8 continuation bytes, so they cannot join two bad sequences into a good one.
    try:
        b"\n".join(texts).decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def _property_blocks_ok(body: bytes, at: list[int]) -> bool:
    """Whether each ``body[at[2k]:at[2k+1]]`` is exactly one msgpack map: skipped, not built, so
    a block costs about a tenth of decoding it (strings inside are checked by the consumer)."""
    if not at:
        return True
    for k in range(0, len(at), 2):
        if body[at[k]] not in _MAP_MARKERS:
            return False
    unpacker = msgpack.Unpacker(max_buffer_size=len(body) + 1)
    unpacker.feed(b"".join(body[at[k] : at[k + 1]] for k in range(0, len(at), 2)))
    offset = 0
    try:
        for k in range(0, len(at), 2):
            unpacker.skip()
            offset += at[k + 1] - at[k]
            if unpacker.tell() != offset:
                return False
    except Exception:  # msgpack raises many types for bad input
        return False
    return True


# First bytes of a msgpack map: fixmap, map 16, map 32.
_MAP_MARKERS = frozenset([*range(0x80, 0x90), 0xDE, 0xDF])
_PROPS_LEN = struct.Struct("<I")
_PROPS_LEN_POS = 28  # of props_len in the header (see the layout above)


def message_problem(body: bytes, sm: ScannedMessage, limits: Limits = DEFAULT_LIMITS) -> str | None:
    """Why the broker must refuse a scanned message of a batch that split fine, or None.

    The broker stores what a producer sent and never decodes it again, so what consumers will
    decode is checked once at send: the id and tags are UTF-8 text, the attempt count is in
    range and the properties are one msgpack map (its keys and strings are decoded, and
    checked, by consumers: an unreadable one is dead-lettered there with the reason).
    """
    try:
        sm.message_id.decode("utf-8")
    except UnicodeDecodeError as exc:
        return f"its message id is not valid UTF-8 (byte {exc.start}); message ids are text"
    if sm.tags:
        try:
            decode_tags(sm.tags)
        except (UnicodeDecodeError, RemoteProtocolError) as exc:
            return f"its tags are not valid UTF-8 text ({exc})"
    if sm.times > limits.attempts_max:
        return f"its attempt count (times) {sm.times} is over attempts_max {limits.attempts_max}"
    plen = _PROPS_LEN.unpack_from(body, sm.pos + _PROPS_LEN_POS)[0]
    if plen:
        start = sm.pos + HEADER_BYTES + len(sm.subject) + len(sm.message_id) + len(sm.tags)
        if not _property_blocks_ok(body, [start, start + plen]):
            return "its properties are not one msgpack map"
    return None


def delivery_attempt(times: int) -> int:
    """The delivery attempt a stored ``times`` stands for: itself, or 1 for the 0 that producers
    before qmq 0.2 wrote for a first send."""
    return times if times > 0 else 1


def with_times(
    encoded: bytes,
    times: int,
    subject: bytes | None = None,
    deliver_at_ms: int | None = None,
    properties: bytes | None = None,
) -> bytes:
    """A copy of an encoded message with a new attempt count, and optionally a new subject, due
    time or (encoded, see ``encode_properties``) properties; id, tags and body stay as they are."""
    if not 0 <= times <= TIMES_MAX:
        raise InvalidMessageError(f"attempt count {times} is outside 0..{TIMES_MAX}")
    fields = list(HEADER.unpack_from(encoded, 0))
    old_slen, ilen, tlen, old_plen = fields[2], fields[3], fields[5], fields[10]
    fields[8] = times
    if deliver_at_ms is not None:
        fields[7] = deliver_at_ms
    if subject is None:
        subject = encoded[HEADER_BYTES : HEADER_BYTES + old_slen]
    fields[2] = len(subject)
    after_subject = HEADER_BYTES + old_slen
    if properties is None:
        return HEADER.pack(*fields) + subject + encoded[after_subject:]
    props_at = after_subject + ilen + tlen
    fields[10] = len(properties)
    return b"".join(
        (
            HEADER.pack(*fields),
            subject,
            encoded[after_subject:props_at],
            properties,
            encoded[props_at + old_plen :],
        )
    )


def repeat_copy(encoded: bytes | memoryview, copy: int, deliver_at_ms: int, properties: bytes) -> bytes:
    """Copy ``copy`` of a repeating delay message: due at ``deliver_at_ms``, with (encoded) new
    ``properties``, ``FLAG_REPEAT`` cleared (a copy is never repeated again, even when a
    consumer's retry sends it through a delay server) and ``FLAG_ORDERED`` too (its field now
    holds the copy); id, tags and body stay as they are."""
    fields = list(HEADER.unpack_from(encoded, 0))
    slen, ilen, tlen, old_plen = fields[2], fields[3], fields[5], fields[10]
    fields[1] &= ~(FLAG_REPEAT | FLAG_ORDERED)
    fields[7] = deliver_at_ms
    fields[9] = copy
    fields[10] = len(properties)
    props_at = HEADER_BYTES + slen + ilen + tlen
    return b"".join((HEADER.pack(*fields), encoded[HEADER_BYTES:props_at], properties, encoded[props_at + old_plen :]))


def properties_of(props: Mapping[str, Any]) -> dict[str, PropertyValue]:
    return dict(props)
