"""Outgoing messages: ``Message``, the checks that run when a field is set, message ids, and
the one-time encoding a producer sends.

Message ids read ``yyMMddHHmmssSSS.<node>.<pid>.<counter>``: the UTC creation time to the
millisecond (so stored ids can be pruned by age), a 6-hex node id chosen once per process,
the process id and a per-process counter. Ids are unique per process without coordination;
the node id tells apart processes that reuse a pid on other hosts.
"""

from __future__ import annotations

import itertools
import os
import re
import secrets
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from types import MappingProxyType

from qmq.common.errors import InvalidMessageError, MessageTooLargeError
from qmq.common.limits import DEFAULT_LIMITS, REPEAT_COPIES_MAX, REPEAT_EVERY_MS_MIN
from qmq.common.naming import check_subject
from qmq.common.ordering import ORDER_KEY_PROPERTY, OrderMode, check_order_key, check_order_mode, slot_of
from qmq.protocol.message import (
    FLAG_REPEAT,
    FLAGS_POS,
    REPEAT_EVERY_PROPERTY,
    REPEAT_TIMES_PROPERTY,
    PropertyValue,
    check_property,
    check_tag,
    check_utf8,
    encode_message,
    encode_properties,
    encode_tags,
)

_LIMITS = DEFAULT_LIMITS
# The id length field of the encoded message is one byte.
_ID_BYTES_MAX = 255
_ID_FORBIDDEN = re.compile(r"[\s\x00-\x1f\x7f]")
# Subjects checked once, with their encoded form; cleared when full so memory stays bounded.
_SUBJECTS_CACHED_MAX = 10_000
_subject_bytes: dict[str, bytes] = {}


def subject_bytes(subject: object) -> bytes:
    """The UTF-8 bytes of a valid subject; InvalidSubjectError naming it otherwise."""
    cached = _subject_bytes.get(subject) if isinstance(subject, str) else None
    if cached is not None:
        return cached
    raw = check_subject(subject).encode("utf-8")
    if len(_subject_bytes) >= _SUBJECTS_CACHED_MAX:
        _subject_bytes.clear()
    _subject_bytes[subject] = raw  # type: ignore[index]  # check_subject proved it a str
    return raw


class MessageIds:
    """Makes message ids and their creation times; one instance per process (``MESSAGE_IDS``).

    Lock-free: the counter is one atomic ``next()`` under the GIL, and the cached prefix is
    one tuple swapped whole, so a thread never sees a prefix of another millisecond's time.
    """

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.node = secrets.token_hex(3)
        self.pid = os.getpid()
        self._counter = itertools.count(1)
        self._tail = f".{self.node}.{self.pid}."
        self._stamp: tuple[int, str] = (-1, "")  # (epoch ms, id prefix of that millisecond)
        self._second: tuple[int, str] = (-1, "")  # (epoch s, yyMMddHHmmss of that second)

    def after_fork(self) -> None:
        """A forked child is another process: new node id, its own pid and counter."""
        self._reset()

    def next(self) -> tuple[str, int]:
        """A fresh id and its creation time (epoch ms)."""
        now_ms = time.time_ns() // 1_000_000
        n = next(self._counter)
        ms, prefix = self._stamp
        if ms != now_ms:
            prefix = self._prefix(now_ms)
        return prefix + str(n), now_ms

    def _prefix(self, now_ms: int) -> str:
        sec = now_ms // 1000
        cached_sec, text = self._second
        if cached_sec != sec:
            text = time.strftime("%y%m%d%H%M%S", time.gmtime(sec))
            self._second = (sec, text)
        prefix = f"{text}{now_ms % 1000:03d}{self._tail}"
        self._stamp = (now_ms, prefix)
        return prefix


MESSAGE_IDS = MessageIds()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=MESSAGE_IDS.after_fork)


def _utf8(what: str, text: str) -> bytes:
    check_utf8(what, text)
    return text.encode("utf-8")


def check_message_id(message_id: object) -> str:
    if not isinstance(message_id, str) or not message_id:
        raise InvalidMessageError(f"message id must be a non-empty string, got {message_id!r}")
    if len(message_id) > _LIMITS.message_id_chars_max or len(_utf8("message id", message_id)) > _ID_BYTES_MAX:
        raise InvalidMessageError(
            f"message id {message_id[:40]!r}… is too long; the limit is {_LIMITS.message_id_chars_max} "
            f"characters ({_ID_BYTES_MAX} bytes in UTF-8)"
        )
    bad = _ID_FORBIDDEN.search(message_id)
    if bad:
        raise InvalidMessageError(
            f"message id {message_id!r} contains {bad.group()!r} at position {bad.start()}; "
            "use visible characters without whitespace"
        )
    return message_id


def _body_bytes(body: object) -> bytes:
    if type(body) is bytes:
        raw = body
    elif isinstance(body, str):
        raw = _utf8("message body", body)
    elif isinstance(body, bytes | bytearray | memoryview):
        raw = bytes(body)
    else:
        raise InvalidMessageError(f"message body must be bytes or str, got {type(body).__name__}")
    if len(raw) > _LIMITS.body_bytes_max:
        raise MessageTooLargeError(
            f"message body of {len(raw)} bytes exceeds body_bytes_max {_LIMITS.body_bytes_max}; "
            "send large data by reference (a key to where it is stored)"
        )
    return raw


_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
_ONE_MS = timedelta(milliseconds=1)
# deliver_at_ms is an i64 of epoch milliseconds; datetime itself stops at year 9999.
_DELIVER_AT_MS_MAX = 253_402_300_799_999
# Seconds a delay or due time may be given as: past the year 9999 either way, yet exact as a float.
_SECONDS_MAX = 1e12


def _iso_ms(epoch_ms: int) -> str:
    return datetime.fromtimestamp(epoch_ms / 1000, tz=UTC).isoformat(timespec="milliseconds")


def _ceil_ms(seconds: float) -> int:
    """Epoch seconds as whole milliseconds, rounded up (a due time is never moved earlier).

    Less than a microsecond past a millisecond counts as float noise (1.7e12 ms carries about
    2e-4 ms of it), not as a reason to add a millisecond.
    """
    ms = seconds * 1000.0
    whole = int(ms)
    return whole + 1 if ms - whole > 0.001 else whole


def _seconds(what: str, value: object) -> float:
    kind = type(value)
    if kind is float:  # the common cases first: set on every delayed send
        if value - value == 0.0:  # type: ignore[operator]  # finite: inf - inf and nan - nan are nan
            return value  # type: ignore[return-value]
    elif kind is int and -_SECONDS_MAX <= value <= _SECONDS_MAX:  # type: ignore[operator]
        return float(value)  # type: ignore[arg-type]
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidMessageError(f"{what} must be a number of seconds or a datetime.timedelta, got {value!r}")
    if not -_SECONDS_MAX <= value <= _SECONDS_MAX:  # also NaN, and ints too large for a float
        shown = repr(value) if len(repr(value)) <= 40 else f"{repr(value)[:20]}…"
        raise InvalidMessageError(
            f"{what} = {shown} is not a finite number of seconds within ±{_SECONDS_MAX:.0e} (before the year 9999)"
        )
    return float(value)


# Shared empty containers of messages without properties or tags; replaced on first set.
_NO_PROPERTIES: dict[str, PropertyValue] = {}
_NO_TAGS: list[str] = []


class Message:
    """A message to send: subject, id, properties, tags and an optional body.

    Every setter checks its value at once, so a bad value raises ``InvalidMessageError`` at
    the line that set it, not later in the producer. Make one with
    ``producer.generate_message(subject)`` or ``Message(subject)``.
    """

    __slots__ = (
        "_body",
        "_created_ms",
        "_deliver_at_ms",
        "_message_id",
        "_order",
        "_order_key",
        "_properties",
        "_repeat",
        "_subject",
        "_subject_raw",
        "_tags",
    )

    def __init__(
        self,
        subject: str,
        *,
        message_id: str | None = None,
        body: bytes | str = b"",
        properties: Mapping[str, PropertyValue] | None = None,
        tags: Iterable[str] = (),
    ) -> None:
        self._subject_raw = subject_bytes(subject)
        self._subject = subject
        if message_id is None:
            self._message_id, self._created_ms = MESSAGE_IDS.next()
        else:
            self._message_id = check_message_id(message_id)
            self._created_ms = time.time_ns() // 1_000_000
        self._body = _body_bytes(body) if body else b""
        self._properties: dict[str, PropertyValue] = _NO_PROPERTIES
        self._tags: list[str] = _NO_TAGS
        self._deliver_at_ms = 0
        self._repeat: tuple[int, int, int] | None = None  # (every_ms, times or 0, until_ms or 0)
        self._order_key: str | None = None
        self._order: OrderMode = "strict"
        if properties:
            for key, value in properties.items():
                self.set_property(key, value)
        for tag in tags:
            self.add_tag(tag)

    @classmethod
    def generate(cls, subject: str) -> Message:
        """A new message to ``subject`` with a fresh id: ``Message(subject)`` on the fast path."""
        m = cls.__new__(cls)
        m._subject_raw = subject_bytes(subject)
        m._subject = subject
        m._message_id, m._created_ms = MESSAGE_IDS.next()
        m._body = b""
        m._properties = _NO_PROPERTIES
        m._tags = _NO_TAGS
        m._deliver_at_ms = 0
        m._repeat = None
        m._order_key = None
        m._order = "strict"
        return m

    @property
    def subject(self) -> str:
        return self._subject

    @property
    def message_id(self) -> str:
        return self._message_id

    @property
    def body(self) -> bytes:
        return self._body

    @body.setter
    def body(self, value: bytes | bytearray | memoryview | str) -> None:
        self._body = _body_bytes(value)

    @property
    def created_ms(self) -> int:
        """Creation time, epoch milliseconds (the time in the id of a generated message)."""
        return self._created_ms

    @property
    def created_at(self) -> datetime:
        return datetime.fromtimestamp(self._created_ms / 1000, tz=UTC)

    def set_delay(self, delay: float | timedelta) -> None:
        """Deliver the message ``delay`` from now (seconds, or a ``timedelta``); see ``set_deliver_at``."""
        if isinstance(delay, timedelta):
            seconds = delay.total_seconds()
        else:
            seconds = _seconds("delay", delay)
        self._set_deliver_at_ms(_ceil_ms(time.time_ns() / 1e9 + seconds), delay, "a delay of ")

    def set_deliver_at(self, when: datetime | float) -> None:
        """Deliver the message at ``when``: an aware ``datetime`` or epoch seconds.

        Consumers of the subject receive it then, as an ordinary message, never before. A time
        in the past (or within a few milliseconds) means now. A time beyond the delay server's
        horizon (730 days by default) makes the send fail; it is never moved.
        """
        if isinstance(when, datetime):
            if when.tzinfo is None or when.utcoffset() is None:
                raise InvalidMessageError(
                    f"deliver_at {when.isoformat()} has no time zone; pass an aware datetime, e.g. "
                    "datetime.now(timezone.utc) + timedelta(minutes=5) or datetime(..., tzinfo=ZoneInfo(...))"
                )
            ms = -((_EPOCH - when) // _ONE_MS)  # exact, rounded up
            self._set_deliver_at_ms(ms, when)
            return
        seconds = _seconds("deliver_at", when)
        if seconds < 0:
            raise InvalidMessageError(
                f"deliver_at = {when!r} is before 1970; pass epoch seconds (time.time() + 60) or an aware datetime"
            )
        self._set_deliver_at_ms(_ceil_ms(seconds), when)

    def _set_deliver_at_ms(self, ms: int, given: object, what: str = "") -> None:
        if ms > _DELIVER_AT_MS_MAX:
            shown = given.isoformat() if isinstance(given, datetime) else repr(given)
            raise InvalidMessageError(f"deliver_at {what}{shown} is after the year 9999; no delay server holds it")
        self._deliver_at_ms = ms if ms > 1 else 1

    @property
    def deliver_at(self) -> datetime | None:
        """When the message is due (aware, UTC), or None for a message delivered as soon as stored."""
        if not self._deliver_at_ms:
            return None
        return datetime.fromtimestamp(self._deliver_at_ms / 1000, tz=UTC)

    @property
    def deliver_at_ms(self) -> int:
        """Due time in epoch milliseconds; 0 for a message delivered as soon as stored."""
        return self._deliver_at_ms

    def set_repeat(self, every: float | timedelta, times: int | None = None, until: datetime | None = None) -> None:
        """Deliver the message again and again: ``times`` copies (or as many as fit up to
        ``until``, an aware datetime), ``every`` apart (seconds or a ``timedelta``).

        The first copy is due one interval after the send, or at ``set_delay``/``set_deliver_at``
        when given. Every copy has the same message id and its number (1, 2, ...) in the
        property named "qmq.repeat.copy"; ``producer.cancel_delay(message_id)`` cancels every copy
        still pending. Bounds: ``every`` at least 1 s, at most 10,000 copies, the last within
        the delay server's horizon (730 days by default); past one the send is refused.
        """
        seconds = every.total_seconds() if isinstance(every, timedelta) else _seconds("repeat every", every)
        every_ms = _ceil_ms(seconds) if seconds > 0 else 0
        if every_ms < REPEAT_EVERY_MS_MIN:
            raise InvalidMessageError(
                f"repeat every {every!r} is under the least interval, {REPEAT_EVERY_MS_MIN // 1000} s: "
                "repeat less often"
            )
        if (times is None) == (until is None):
            raise InvalidMessageError("give set_repeat one end: times=N copies, or until= an aware datetime")
        if times is not None:
            if isinstance(times, bool) or not isinstance(times, int) or not 1 <= times <= REPEAT_COPIES_MAX:
                raise InvalidMessageError(
                    f"repeat times={times!r} is outside 1..{REPEAT_COPIES_MAX}, the copies a message may have"
                )
            self._repeat = (every_ms, times, 0)
            return
        assert until is not None
        if not isinstance(until, datetime) or until.tzinfo is None or until.utcoffset() is None:
            raise InvalidMessageError(
                f"repeat until={until!r} must be an aware datetime, e.g. datetime.now(timezone.utc) + timedelta(days=1)"
            )
        self._repeat = (every_ms, 0, -((_EPOCH - until) // _ONE_MS))

    @property
    def repeat(self) -> tuple[timedelta, int | None, datetime | None] | None:
        """``(every, times, until)`` as given to ``set_repeat``, or None for a message sent once."""
        if self._repeat is None:
            return None
        every_ms, times, until_ms = self._repeat
        until = datetime.fromtimestamp(until_ms / 1000, tz=UTC) if until_ms else None
        return timedelta(milliseconds=every_ms), times or None, until

    def set_order_key(self, key: str, *, order: OrderMode = "strict") -> None:
        """Keep this message in order with the other messages of ``key`` (a str of 1–128
        characters) from this producer: stored in send order, handled one at a time in that order
        by ordered consumers (see docs/ordered.md).

        ``order="strict"`` (the default) sends it only to the key's broker group, waiting for that
        group and failing the send rather than writing it elsewhere; ``"best_effort"`` fails over
        to another group, which may break the key's order while its group is down.
        """
        self._order_key = check_order_key(key)
        self._order = check_order_mode(order)

    @property
    def order_key(self) -> str | None:
        """The order key, or None for a message without one."""
        return self._order_key

    @property
    def order(self) -> OrderMode:
        """How an ordered message is placed when its broker group is down: "strict" or "best_effort"."""
        return self._order

    def set_property(self, key: str, value: PropertyValue) -> None:
        """Set a property: a str, int (64-bit), float, bool or bytes value under a string key."""
        check_property(key, value, _LIMITS)
        if self._properties is _NO_PROPERTIES:
            self._properties = {}
        if key not in self._properties and len(self._properties) >= _LIMITS.properties_max:
            raise InvalidMessageError(
                f"cannot set property {key!r}: the message already has {_LIMITS.properties_max} properties, "
                "the limit; put bulk data in the body"
            )
        self._properties[key] = value

    def get_property(self, key: str, default: PropertyValue | None = None) -> PropertyValue | None:
        return self._properties.get(key, default)

    @property
    def properties(self) -> Mapping[str, PropertyValue]:
        """A read-only view; use ``set_property`` to change it."""
        return MappingProxyType(self._properties)

    def add_tag(self, tag: str) -> None:
        """Add a tag consumers can filter on (at most 10 a message; adding one twice keeps one)."""
        check_tag(tag, _LIMITS)
        if tag in self._tags:
            return
        if self._tags is _NO_TAGS:
            self._tags = []
        if len(self._tags) >= _LIMITS.tags_max:
            raise InvalidMessageError(
                f"cannot add tag {tag!r}: the message already has {_LIMITS.tags_max} tags, the limit"
            )
        self._tags.append(tag)

    @property
    def tags(self) -> tuple[str, ...]:
        return tuple(self._tags)

    def encode(self, times: int = 1) -> bytes:
        """The message as sent on the wire (``qmq.protocol.message``) for delivery attempt
        ``times`` (1: a first send); checks the total size."""
        tags = self._tags
        props = self._properties
        deliver_at_ms = self._deliver_at_ms
        if self._repeat is not None:
            if self._order_key is not None:
                raise InvalidMessageError(
                    f"message {self._message_id} has an order key and repeats; an ordered message is delivered "
                    "in its key's order, not at times: drop set_repeat, or the order key"
                )
            props, deliver_at_ms = self._repeating(props)
        order_slot = 0
        if self._order_key is not None:
            props = {**props, ORDER_KEY_PROPERTY: self._order_key}
            order_slot = slot_of(self._order_key) + 1
        raw = encode_message(
            self._subject_raw,
            self._message_id.encode("utf-8"),
            encode_tags(tags) if tags else b"",
            len(tags),
            encode_properties(props) if props else b"",
            self._body,
            self._created_ms,
            deliver_at_ms,
            times,
            order_slot,
        )
        if self._repeat is not None:
            raw = raw[:FLAGS_POS] + bytes([raw[FLAGS_POS] | FLAG_REPEAT]) + raw[FLAGS_POS + 1 :]
        if len(raw) > _LIMITS.message_bytes_max:
            raise MessageTooLargeError(
                f"message {self._message_id} encodes to {len(raw)} bytes, over message_bytes_max "
                f"{_LIMITS.message_bytes_max}; make the body or the properties smaller"
            )
        return raw

    def _repeating(self, props: dict[str, PropertyValue]) -> tuple[dict[str, PropertyValue], int]:
        """The properties and first due time a repeating message is sent with (now: the first copy
        is one interval after the send unless a due time was set)."""
        assert self._repeat is not None
        every_ms, times, until_ms = self._repeat
        first_ms = self._deliver_at_ms or time.time_ns() // 1_000_000 + every_ms
        if not times:
            if until_ms < first_ms:
                raise InvalidMessageError(
                    f"repeat until {_iso_ms(until_ms)} is before the first copy, due {_iso_ms(first_ms)}"
                )
            times = (until_ms - first_ms) // every_ms + 1
            if times > REPEAT_COPIES_MAX:
                raise InvalidMessageError(
                    f"repeating every {every_ms / 1000:g} s until {_iso_ms(until_ms)} makes {times:,} copies; "
                    f"the most is {REPEAT_COPIES_MAX:,}: repeat less often or end sooner"
                )
        return {**props, REPEAT_EVERY_PROPERTY: every_ms, REPEAT_TIMES_PROPERTY: times}, first_ms

    def __repr__(self) -> str:
        return (
            f"Message(subject={self._subject!r}, message_id={self._message_id!r}, "
            f"properties={len(self._properties)}, tags={self._tags!r}, body={len(self._body)} bytes"
            + (f", deliver_at={self.deliver_at.isoformat()}" if self.deliver_at else "")
            + ")"
        )
