"""Incoming messages: ``ReceivedMessage`` over a slice of a pull response, the ``Batch`` a
pull returns, and the parser that turns the response body into them.

A pull response body is stored records back to back (``qmq.protocol.record``). Parsing
reads two fixed headers per record with ``struct.unpack_from`` and keeps offsets into the
body; the message id, properties, tags and body are decoded only when asked for.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Awaitable, Generator, Iterable
from datetime import UTC, datetime
from typing import Any, Generic, TypeVar

import crc32c

from qmq.client.acks import AckTracker
from qmq.common.ordering import ORDER_KEY_PROPERTY
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import (
    FLAG_ORDERED,
    HEADER_BYTES,
    VERSION,
    PropertyValue,
    decode_properties,
    decode_tags,
    delivery_attempt,
)
from qmq.protocol.record import RECORD_AND_MESSAGE_HEADERS, RECORD_HEADER_BYTES, RECORD_MAGIC

log = logging.getLogger(__name__)

# A record header and the header of the message in it, read with one unpack.
_HEADERS = RECORD_AND_MESSAGE_HEADERS
# Fields of that tuple: the record's, then the message's (qmq.protocol.message.HEADER).
_MAGIC, _CRC, _LENGTH, _SEQUENCE, _STORED = 0, 1, 2, 3, 4
_VERSION, _FLAGS, _SLEN, _ILEN, _TLEN, _CREATED, _TIMES, _ORDER_SLOT, _PLEN, _BLEN = 5, 6, 7, 8, 10, 11, 13, 14, 15, 16
# A record of a pull response read and checked: where its message begins, where its body begins,
# where it ends, and its headers.
ParsedRecord = tuple[int, int, int, tuple[Any, ...]]


class Acked:
    """What ``ack()`` returns: already done, and awaitable so ``await m.ack()`` reads naturally."""

    __slots__ = ()

    def __await__(self) -> Generator[None, None, None]:
        return
        yield  # makes this a generator function; never reached

    def __repr__(self) -> str:
        return "<acked>"


ACKED = Acked()


class ReceivedBase:
    """The fields of a received message; the asyncio and blocking SDKs add ``ack``/``nack``."""

    __slots__ = (
        "_body_pos",
        "_buf",
        "_end",
        "_h",
        "_offset",
        "_pos",
        "_props",
        "_settled",
        "_tracker",
        "subject",
    )

    def __init__(
        self,
        buf: bytes,
        pos: int,
        body_pos: int,
        end: int,
        header: tuple[Any, ...],
        offset: int,
        subject: str,
        tracker: AckTracker,
    ) -> None:
        # The message is buf[pos:end]; its body, the last field, is buf[body_pos:end].
        self._buf = buf
        self._pos = pos
        self._body_pos = body_pos
        self._end = end
        self._h = header  # record and message header fields (_HEADERS)
        self._offset = offset
        self.subject = subject
        """The subject it was sent to (for a retried message, the original subject)."""
        self._tracker = tracker
        self._props: dict[str, PropertyValue] | None = None
        self._settled = False

    @property
    def sequence(self) -> int:
        """The message's place in its subject's consume log."""
        return int(self._h[_SEQUENCE])

    @property
    def stored_ms(self) -> int:
        """When the broker stored it (epoch ms)."""
        return int(self._h[_STORED])

    @property
    def message_id(self) -> str:
        h = self._h
        start = self._pos + HEADER_BYTES + h[_SLEN]
        return self._buf[start : start + h[_ILEN]].decode("utf-8")

    @property
    def body(self) -> bytes:
        return self._buf[self._body_pos : self._end]

    @property
    def properties(self) -> dict[str, PropertyValue]:
        props = self._props
        if props is None:
            h = self._h
            plen = h[_PLEN]
            if plen:
                start = self._pos + HEADER_BYTES + h[_SLEN] + h[_ILEN] + h[_TLEN]
                props = decode_properties(self._buf[start : start + plen])
            else:
                props = {}
            self._props = props
        return props

    def get_property(self, key: str, default: PropertyValue | None = None) -> PropertyValue | None:
        return self.properties.get(key, default)

    @property
    def tags(self) -> tuple[str, ...]:
        h = self._h
        tlen = h[_TLEN]
        if not tlen:
            return ()
        start = self._pos + HEADER_BYTES + h[_SLEN] + h[_ILEN]
        return tuple(decode_tags(self._buf[start : start + tlen]))

    @property
    def times(self) -> int:
        """Delivery attempt: 1 for a first delivery, n + 1 after n failures (as on the wire)."""
        return delivery_attempt(self._h[_TIMES])

    @property
    def order_key(self) -> str | None:
        """The order key it was sent with (``Message.set_order_key``), or None."""
        if self.order_slot is None:
            return None
        key = self.properties.get(ORDER_KEY_PROPERTY)
        return key if isinstance(key, str) else None

    @property
    def order_slot(self) -> int | None:
        """The logical slot of its order key (0–1023), or None without one."""
        h = self._h
        if not h[_FLAGS] & FLAG_ORDERED:  # the field is a repeat's copy number, or 0
            return None
        slot: int = h[_ORDER_SLOT]
        return slot - 1 if slot else None

    def _count_attempt(self) -> None:
        """One more attempt of this copy, retried in place by an ordered consumer: ``times`` + 1."""
        h = self._h
        self._h = (*h[:_TIMES], delivery_attempt(h[_TIMES]) + 1, *h[_TIMES + 1 :])

    @property
    def created_ms(self) -> int:
        return int(self._h[_CREATED])

    @property
    def created_at(self) -> datetime:
        return datetime.fromtimestamp(self._h[_CREATED] / 1000, tz=UTC)

    @property
    def stored_at(self) -> datetime:
        return datetime.fromtimestamp(self._h[_STORED] / 1000, tz=UTC)

    @property
    def pull_offset(self) -> int:
        """Where it sits in this consumer's pull log (what an ack records)."""
        return self._offset

    @property
    def encoded(self) -> bytes:
        """The message exactly as the producer encoded it (for re-sending to %RETRY%)."""
        return self._buf[self._pos : self._end]

    @property
    def settled(self) -> bool:
        """Whether it was acknowledged or failed already."""
        return self._settled

    def unreadable(self) -> str | None:
        """Why this message cannot be read (an id, tag or properties that do not decode), or None.

        The broker refuses such messages at send; one can still come from data written before it
        did. The consumer dead-letters it with this reason instead of handing it to a handler.
        """
        try:
            self.message_id  # noqa: B018  # decoding is the check
        except UnicodeDecodeError as exc:
            return f"its message id is not valid UTF-8 ({exc})"
        try:
            self.tags  # noqa: B018
        except (UnicodeDecodeError, RemoteProtocolError) as exc:
            return f"its tags cannot be read ({exc})"
        try:
            self.properties  # noqa: B018
        except RemoteProtocolError as exc:
            return f"its properties cannot be read ({exc})"
        return None

    @property
    def printable_id(self) -> str:
        """The message id for logs and errors, whatever bytes it holds."""
        h = self._h
        start = self._pos + HEADER_BYTES + h[_SLEN]
        return self._buf[start : start + h[_ILEN]].decode("utf-8", "backslashreplace")

    def _ack_now(self) -> None:
        if not self._settled:
            self._tracker.ack(self._offset)  # raises, leaving it unsettled, once the consumer closed
            self._settled = True

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(subject={self.subject!r}, message_id={self.message_id!r}, "
            f"times={self.times}, sequence={self.sequence}, body={self._end - self._body_pos} bytes)"
        )


def _log_nack_failure(task: asyncio.Task[None]) -> None:
    # Marks the exception retrieved, so a nack nobody awaited still leaves a trace.
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("failing a message (re-send to its retry subject) did not succeed: %s", exc)


class ReceivedMessage(ReceivedBase):
    """A message from a pull (asyncio SDK): read its fields, then ``ack()`` or ``nack()`` it."""

    __slots__ = ()

    def ack(self) -> Acked:
        """Record it as done; sent to the broker with the next pull or within ``ack_flush_ms``."""
        self._ack_now()
        return ACKED

    def nack(self, exc: BaseException | None = None) -> Awaitable[None]:
        """Fail it: it comes back later with ``times + 1`` (after ``max_retries``, to %DEAD_RETRY%).

        Returns a task that finishes once the retry copy is stored and this one acknowledged.
        When that fails (no broker took the copy) the message is unsettled again, so it can be
        nacked again (or acked); until then the broker holds it unacknowledged.
        """
        if self._settled or self._tracker.on_nack is None:
            return ACKED
        self._settled = True
        task = asyncio.ensure_future(self._tracker.on_nack(self, exc))
        task.add_done_callback(_log_nack_failure)
        task.add_done_callback(self._nack_done)
        return task

    def _nack_done(self, task: asyncio.Task[None]) -> None:
        if task.cancelled() or task.exception() is not None:
            self._settled = False


M = TypeVar("M", bound=ReceivedBase)


class BatchBase(list[M], Generic[M]):
    """A list of received messages that can be acknowledged together."""

    def _ack_all_now(self) -> None:
        tracker: AckTracker | None = None
        offsets: list[int] = []
        for m in self:
            if m._tracker.closed:
                raise m._tracker._closed_error()
        for m in self:
            if m._settled:
                continue
            m._settled = True
            if m._tracker is not tracker:
                if tracker is not None and offsets:
                    tracker.ack_many(offsets)
                    offsets = []
                tracker = m._tracker
            offsets.append(m._offset)
        if tracker is not None and offsets:
            tracker.ack_many(offsets)


class Batch(BatchBase[ReceivedMessage]):
    """What ``PullConsumer.pull`` returns: a list of ``ReceivedMessage`` with ``ack_all()``."""

    def ack_all(self) -> Acked:
        """Acknowledge every message of the batch not acknowledged or failed yet."""
        self._ack_all_now()
        return ACKED


def parse_runs(runs: object) -> list[tuple[int, int]]:
    """The ``runs`` of a PULL response, checked: ``[[pull_offset, count], ...]``."""
    if not isinstance(runs, list):
        raise RemoteProtocolError(f"PULL response 'runs' must be a list, got {type(runs).__name__}")
    out: list[tuple[int, int]] = []
    for run in runs:
        if (
            not isinstance(run, list | tuple)
            or len(run) != 2
            or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in run)
        ):
            raise RemoteProtocolError(f"PULL response run {run!r} is not [pull_offset, count]")
        out.append((run[0], run[1]))
    return out


def parse_records(
    body: bytes,
    runs: Iterable[tuple[int, int]],
    subject: str,
    tracker: AckTracker,
    into: BatchBase[M],
    make: type[M],
    check_crc: bool = True,
    kept: list[ParsedRecord] | None = None,
) -> None:
    """Append one ``make(...)`` per record of a PULL response body to ``into``; with ``kept``,
    each record's place and headers too, for ``make_records`` to make another group's messages
    of the same records (a fan-out's PULL_MANY answer carries them once).

    Raises RemoteProtocolError when the body does not hold exactly the records ``runs``
    announce, or a record is damaged.
    """
    append = into.append
    unpack = _HEADERS.unpack_from
    crc = crc32c.crc32c
    view = memoryview(body) if check_crc else None
    end = len(body)
    pos = 0
    try:
        for pull_offset, count in runs:
            for k in range(count):
                h = unpack(body, pos)
                mpos = pos + RECORD_HEADER_BYTES
                mend = mpos + h[_LENGTH]
                body_pos = mpos + HEADER_BYTES + h[_SLEN] + h[_ILEN] + h[_TLEN] + h[_PLEN]
                if h[_MAGIC] != RECORD_MAGIC or h[_VERSION] != VERSION or body_pos + h[_BLEN] != mend or mend > end:
                    raise RemoteProtocolError(
                        f"PULL response record at byte {pos} (pull offset {pull_offset + k}) is malformed: "
                        f"magic 0x{h[_MAGIC]:08X}, length {h[_LENGTH]}, message version {h[_VERSION]}, "
                        f"body of {end} bytes"
                    )
                if view is not None and crc(view[pos + 8 : mend]) != h[_CRC]:
                    raise RemoteProtocolError(
                        f"PULL response record at byte {pos} (sequence {h[_SEQUENCE]}) fails its CRC32C check"
                    )
                append(make(body, mpos, body_pos, mend, h, pull_offset + k, subject, tracker))
                if kept is not None:
                    kept.append((mpos, body_pos, mend, h))
                pos = mend
    except struct.error:
        raise RemoteProtocolError(
            f"PULL response body ends at byte {end}, inside the headers of the record at byte {pos}"
        ) from None
    if pos != end:
        raise RemoteProtocolError(f"PULL response body has {end - pos} bytes after the records its runs announce")


def make_records(
    body: bytes,
    records: list[ParsedRecord],
    runs: Iterable[tuple[int, int]],
    subject: str,
    tracker: AckTracker,
    into: BatchBase[M],
    make: type[M],
) -> None:
    """Append one ``make(...)`` per record ``parse_records`` kept (read and checked already) to
    ``into``, at the pull offsets of ``runs``: another consumer group's messages of the same
    records. Raises RemoteProtocolError when ``runs`` do not count exactly those records."""
    runs = list(runs)
    if sum(count for _offset, count in runs) != len(records):
        raise RemoteProtocolError(
            f"PULL response runs {runs!r} do not count the {len(records)} records they share with another pull"
        )
    append = into.append
    at = 0
    for pull_offset, count in runs:
        for k in range(count):
            mpos, body_pos, mend, h = records[at + k]
            append(make(body, mpos, body_pos, mend, h, pull_offset + k, subject, tracker))
        at += count
