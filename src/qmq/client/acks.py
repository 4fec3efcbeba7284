"""Acknowledgements of one consumer on one (broker group, subject, consumer group).

``ack(offset)`` only records a pull-log offset: it is the per-message path, so it costs a
lock and a list append. Offsets are coalesced into half-open ``[start, end)`` ranges when a
request is about to carry them (a PULL's ``ack`` key or an ACK), and ranges that did not
reach the broker are put back for the next request.

The lock makes ``ack`` callable from any thread (the blocking SDK's handler threads);
everything else runs on the event loop.

A tracker given a ``listed`` set (its consumer's) is added to it by every ack and every put-back,
so a flush of a consumer's acks looks at the trackers acked since the last flush (a pull that
carried their acks meanwhile leaves them there with nothing pending), not at every subject it
ever pulled (40,000 of them, every ``ack_flush_ms``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from qmq.common.errors import QmqError

log = logging.getLogger(__name__)

# An ACK header of this many ranges stays far below frame_header_bytes_max (~12 bytes a range).
ACK_RANGES_PER_REQUEST_MAX = 2_000

Range = list[int]  # [start, end), as on the wire


def coalesce(offsets: Iterable[int], ranges: Iterable[Iterable[int]] = ()) -> list[Range]:
    """Sorted, disjoint, non-adjacent ``[start, end)`` ranges covering ``offsets`` and ``ranges``."""
    spans = sorted([(o, o + 1) for o in offsets] + [(s, e) for s, e in ranges if e > s])
    out: list[Range] = []
    for start, end in spans:
        if out and start <= out[-1][1]:
            if end > out[-1][1]:
                out[-1][1] = end
        else:
            out.append([start, end])
    return out


def _coalesce_sorted_offsets(offsets: list[int]) -> list[Range]:
    # The common case (no ranges put back): one pass over sorted offsets, repeats skipped.
    out: list[Range] = []
    start = end = offsets[0]
    for o in offsets:
        if o == end:
            end += 1
        elif start <= o < end:
            continue
        else:
            out.append([start, end])
            start, end = o, o + 1
    out.append([start, end])
    return out


class AckTracker:
    """Pending acknowledgements for one (broker group, subject, consumer group)."""

    __slots__ = (
        "_lock",
        "_offsets",
        "_ranges",
        "ack_offset",
        "broker_group",
        "closed",
        "group",
        "listed",
        "loop",
        "on_nack",
        "origin_subject",
        "owner",
        "subject",
        "subscription",
        "unheld",
    )

    def __init__(
        self,
        broker_group: str,
        subject: str,
        group: str,
        origin_subject: str,
        on_nack: Callable[[Any, BaseException | None], Coroutine[Any, Any, None]] | None = None,
        subscription: Any = None,
        listed: set[AckTracker] | None = None,
        owner: Any = None,
    ) -> None:
        """``listed``: the set this tracker is in while it has pending acks (None: no set);
        ``owner``: what pulled for it (the SubjectPuller whose acks these are), for the flush."""
        self.broker_group = broker_group
        self.subject = subject
        self.group = group
        # The subject users subscribed to; differs from ``subject`` on %RETRY% subjects.
        self.origin_subject = origin_subject
        self.on_nack = on_nack
        # the consumer group's Subscription (retry budget and back-off of a failed message)
        self.subscription = subscription
        # The event loop ``on_nack`` runs on, for a nack from another thread (blocking SDK).
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ack_offset = -1  # the broker's contiguous acknowledged prefix, when last told
        self._lock = threading.Lock()
        self._offsets: list[int] = []
        self._ranges: list[Range] = []
        self.closed = False  # the consumer closed: an ack could never reach the broker
        # acked positions the broker said it never handed out (a pull a failover or a power loss
        # undid): those acks did nothing, and their messages come again
        self.unheld = 0
        self.listed = listed
        self.owner = owner

    def _list(self) -> None:
        # after acks were added (under self._lock); a set's add is atomic, and a no-op when it is in
        if self.listed is not None:
            self.listed.add(self)

    def relist(self) -> None:
        """Back in ``listed`` if acks are still pending (a flush took it out and could not send them)."""
        with self._lock:
            if self._offsets or self._ranges:
                self._list()

    def ack(self, offset: int) -> None:
        if self.closed:
            raise self._closed_error()
        with self._lock:
            self._offsets.append(offset)
            self._list()

    def ack_many(self, offsets: Iterable[int]) -> None:
        if self.closed:
            raise self._closed_error()
        with self._lock:
            self._offsets.extend(offsets)
            self._list()

    def _closed_error(self) -> QmqError:
        return QmqError(
            f"the consumer that pulled this message of {self.subject!r} (group {self.group!r}) is closed: "
            "the acknowledgement cannot reach the broker, so the message will be delivered again; "
            "ack before closing the consumer"
        )

    @property
    def pending(self) -> bool:
        return bool(self._offsets or self._ranges)

    @property
    def requeued(self) -> bool:
        """Whether ranges a request failed to deliver wait for the next one."""
        return bool(self._ranges)

    def take(self, ranges_max: int = ACK_RANGES_PER_REQUEST_MAX) -> list[Range]:
        """Pending acks as ranges (at most ``ranges_max``; the rest stay pending)."""
        with self._lock:
            offsets, self._offsets = self._offsets, []
            requeued, self._ranges = self._ranges, []
        if not offsets and not requeued:
            return []
        if requeued:
            out = coalesce(offsets, requeued)
        else:
            # sorted() of an already ordered list is one linear pass in C.
            out = _coalesce_sorted_offsets(sorted(offsets))
        if len(out) > ranges_max:
            self.requeue(out[ranges_max:])
            out = out[:ranges_max]
        return out

    def count_unheld(self, n: object) -> None:
        """An answer's count of acked positions the broker never handed out (``unheld``)."""
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            self.unheld += n
            log.warning(
                "broker group %s did not hold %d of the acknowledged messages of %r (group %r): they were "
                "pulled from a master since replaced (or a power loss undid the pull), so the acks did "
                "nothing and the messages come again",
                self.broker_group,
                n,
                self.subject,
                self.group,
            )

    def requeue(self, ranges: list[Range]) -> None:
        """Put back ranges a request failed to deliver; the next request carries them."""
        if ranges:
            with self._lock:
                self._ranges.extend(ranges)
                self._list()
