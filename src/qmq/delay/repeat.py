"""Repeating delay messages: the copies a delay server makes of one send.

A producer sends a repeating message once, with ``FLAG_REPEAT`` and its interval and number of
copies in two properties (qmq.protocol.message); its ``deliver_at_ms`` is when the first copy
is due. The delay server turns it into its copies as the send arrives, before anything is
written: copy ``k`` (1..times) is the same message (id, subject, tags, body) due at
``first + (k - 1) × every``, with the header's ``copy`` field and the property
``REPEAT_COPY_PROPERTY`` set to ``k`` and the flag cleared. The copies are appended to the
write-ahead log together with the send's other messages (one write, acknowledged together:
all of them or none), and from there they are ordinary delay messages: each in the bucket of
its due time, handed over on its own, and recorded in that bucket's dispatch log. Sharing the
id, they are cancelled together (cancel.py); differing in ``copy``, they are not repeats of
one another in a broker's duplicate window, while a copy handed over twice still is.

Bounds, each refused with ``INVALID_MESSAGE`` naming it: an interval of at least
``REPEAT_EVERY_MS_MIN``, 1..``REPEAT_COPIES_MAX`` copies, the last within the horizon, and all
the copies of one send within ``REPEAT_BYTES_MAX`` (qmq.common.limits).
"""

from __future__ import annotations

from datetime import UTC, datetime

from qmq.common.limits import REPEAT_BYTES_MAX, REPEAT_COPIES_MAX, REPEAT_EVERY_MS_MIN, Limits, MiB
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import (
    HEADER,
    HEADER_BYTES,
    REPEAT_COPY_PROPERTY,
    REPEAT_EVERY_PROPERTY,
    REPEAT_TIMES_PROPERTY,
    decode_properties,
    encode_properties,
    repeat_copy,
)

# bytes a copy may grow by: the copy-number property (key and a value up to 10,000)
_COPY_PROPERTY_BYTES_MAX = len(REPEAT_COPY_PROPERTY) + 8


def copies(
    message: memoryview, now_ms: int, horizon_end_ms: int, horizon_days: int, limits: Limits
) -> list[tuple[bytes, int]] | str:
    """``[(copy, due_ms), ...]`` of a message with ``FLAG_REPEAT`` (the whole encoded message),
    or why it is refused."""
    fields = HEADER.unpack_from(message, 0)
    slen, ilen, tlen, plen = fields[2], fields[3], fields[5], fields[10]
    props_at = HEADER_BYTES + slen + ilen + tlen
    try:
        props = decode_properties(message[props_at : props_at + plen])
    except RemoteProtocolError as exc:
        return f"a repeating message needs readable properties: {exc}"
    every_ms = props.get(REPEAT_EVERY_PROPERTY)
    times = props.get(REPEAT_TIMES_PROPERTY)
    if not isinstance(every_ms, int) or not isinstance(times, int) or isinstance(every_ms | times, bool):
        return (
            f"a repeating message needs whole numbers in the properties {REPEAT_EVERY_PROPERTY!r} and "
            f"{REPEAT_TIMES_PROPERTY!r}, got {every_ms!r} and {times!r}; use Message.set_repeat"
        )
    if every_ms < REPEAT_EVERY_MS_MIN:
        return f"repeat interval {every_ms} ms is under the least interval, {REPEAT_EVERY_MS_MIN} ms: repeat less often"
    if not 1 <= times <= REPEAT_COPIES_MAX:
        return f"{times} copies is outside 1..{REPEAT_COPIES_MAX}, the copies a repeating message may have"
    first_ms = fields[7] or now_ms + every_ms
    last_ms = first_ms + (times - 1) * every_ms
    if last_ms > horizon_end_ms:
        return (
            f"the last of {times} copies, every {every_ms} ms, would be due {_iso(last_ms)}, "
            f"{(last_ms - now_ms) / 86_400_000:,.1f} days ahead; the horizon is {horizon_days} days "
            "(horizon_days): send fewer copies or repeat more often"
        )
    copy_bytes_max = len(message) + _COPY_PROPERTY_BYTES_MAX
    if copy_bytes_max > limits.message_bytes_max:
        return (
            f"a copy of this {len(message)}-byte message, with its copy number, would pass message_bytes_max "
            f"{limits.message_bytes_max}: make the message smaller"
        )
    if times * copy_bytes_max > REPEAT_BYTES_MAX:
        return (
            f"{times} copies of a {len(message):,}-byte message make {times * copy_bytes_max / MiB:,.1f} MiB, over "
            f"the {REPEAT_BYTES_MAX // MiB} MiB the copies of one send may take: send fewer copies or a smaller message"
        )
    out = []
    for k in range(1, times + 1):
        props[REPEAT_COPY_PROPERTY] = k
        due_ms = first_ms + (k - 1) * every_ms
        out.append((repeat_copy(message, k, due_ms, encode_properties(props)), due_ms))
    return out


def _iso(epoch_ms: int) -> str:
    try:
        return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")
    except (OverflowError, ValueError, OSError):
        return f"{epoch_ms} ms after the epoch"
