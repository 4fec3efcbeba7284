"""Cancels of pending delay messages: which entries a cancel stops, how it is made durable, and
how the firing side is kept from handing a cancelled message over.

A cancel names a message id. Every bucket is searched through its id file (ids.py); the
entries found that are neither done (in the dispatch log) nor in flight to a broker are
*pending*. If there are any, the cancel is written to the write-ahead log as a record of its
own (a message with ``FLAG_CANCEL``, the id and nothing else: replayed by recovery, and
copied with the log by a delay slave), and then the pending entries are appended to their
buckets' dispatch logs: an entry there is never loaded again, so a cancelled message's bytes
stay on disk until its bucket is deleted and never reach memory. In a bucket already loaded,
the entries also join a small set of the scheduler's (``Scheduler.cancelled``) that the
hand-over drops rows by, since their rows may be in the timer, waiting for their fsync, or
being loaded. The set is dropped with the bucket.

Replaying a cancel record (recovery) cancels what the record's place in the log says was
there: the messages with that id sent before it that no dispatch log names; one sent after it
with the same id is not touched.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple, Protocol

import numpy as np

from qmq.delay.bucket import DISPATCH_DTYPE, Bucket
from qmq.protocol.message import FLAG_CANCEL, FLAGS_POS, HEADER_BYTES, encode_message


class Live(Protocol):
    """The firing side, for buckets loaded into the timer (``Scheduler``)."""

    def in_flight(self, start_ms: int) -> set[int]:
        """Entries of the bucket handed to a broker and not yet written to its dispatch log."""
        ...

    def cancel_loaded(self, start_ms: int, entries: list[int]) -> None:
        """Never hand these entries of a loaded bucket over."""
        ...


class Stop(NamedTuple):
    """Pending entries of one bucket a cancel stops."""

    bucket: Bucket
    entries: list[int]


def cancel_record(message_id: bytes, now_ms: int) -> bytes:
    """The encoded message a cancel is written to the write-ahead log as."""
    encoded = bytearray(encode_message(b"", message_id, b"", 0, b"", b"", now_ms))
    encoded[FLAGS_POS] = FLAG_CANCEL
    return bytes(encoded)


def is_cancel(message: bytes | bytearray | memoryview) -> bool:
    return len(message) >= HEADER_BYTES and bool(message[FLAGS_POS] & FLAG_CANCEL)


def cancelled_id(message: bytes | bytearray | memoryview) -> bytes:
    """The message id a cancel record names."""
    slen = message[2] | message[3] << 8
    start = HEADER_BYTES + slen
    return bytes(message[start : start + message[4]])


def pending_entries(buckets: list[Bucket], message_id: bytes, live: Live | None) -> list[Stop]:
    """What a cancel of ``message_id`` would stop now, bucket by bucket (nothing is changed)."""
    out = []
    for b in buckets:
        found = b.find(message_id)
        if not found:
            continue
        done = set(b.read_dispatched().tolist())
        if live is not None and b.loaded:
            done |= live.in_flight(b.start_ms)
        pending = [e for e in found if e not in done]
        if pending:
            out.append(Stop(b, pending))
    return out


def apply(stops: list[Stop], live: Live | None, on_done: Callable[[int], None]) -> int:
    """Record the entries as done (dispatch logs), tell the firing side; returns how many."""
    n = 0
    for b, entries in stops:
        b.append_dispatch(np.asarray(entries, dtype=DISPATCH_DTYPE).tobytes())
        if live is not None and b.loaded:
            live.cancel_loaded(b.start_ms, entries)
        n += len(entries)
    on_done(n)
    return n
