"""A consumer group's server-side filter (qmq.common.filter_expr) in the shape of a tag filter
(qmq.store.tags), so the store's scan for tags serves it: a message it does not match is passed
over, the group's pull offset moves past it, it counts as consumed for that group and never
crosses the wire.

A message the expression cannot be evaluated over (a body that is not JSON or larger than
``BODY_BYTES_MAX``, an evaluation error) does not match either, and is kept for
``dead_letter_unevaluable``, which the store's pull (BrokerStore.pull) calls in the same call as
the scan, for every pull, a long poll's included: it goes to the group's dead letters with the
reason in the property ``qmq.error``, written before the pull returns, so no letter waits in
memory for a later pull. A scan stops once ``UNEVALUABLE_KEPT_MAX`` are kept (``full``): the
rest waits for the next pull, so none is passed over without its letter.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from qmq.common.filter_expr import BODY_BYTES_MAX, UnevaluableError, compile_filter, evaluate, needs_body, truthy
from qmq.common.naming import dead_subject
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import (
    HEADER,
    TIMES_MAX,
    decode_message,
    decode_properties,
    encode_properties,
    scan_batch,
    with_times,
)
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.intake import Appending
from qmq.store.tags import RecordFilter

log = logging.getLogger(__name__)

__all__ = ["BODY_BYTES_MAX", "GroupFilter", "dead_letter_unevaluable"]

UNEVALUABLE_KEPT_MAX: Final = 100  # messages waiting for the dead letters, per group
# a pull's scan evaluates the filter for at most this long, then stops (the rest is for the next
# pull), so even a filter at its bounds (qmq.common.filter_expr) holds the broker's loop briefly
SCAN_EVAL_NS_MAX: Final = 50_000_000


class GroupFilter:
    """``expr`` compiled once; ``also`` a tag filter the message must pass as well."""

    __slots__ = ("_compiled", "_needs_body", "_scan_ns", "also", "expr", "unevaluable", "waiting")

    def __init__(self, expr: str, also: RecordFilter | None = None) -> None:
        self.expr = expr
        self._compiled: Any = compile_filter(expr)
        self._needs_body = needs_body(expr)
        self.also = also
        self.unevaluable = 0
        self.waiting: list[tuple[bytes, str]] = []  # (message, reason), shared with with_tags' copies
        self._scan_ns = 0  # time spent evaluating in the scan being made (begin_scan)

    def with_tags(self, tags: RecordFilter | None) -> GroupFilter:
        if tags is None:
            return self
        out = GroupFilter.__new__(GroupFilter)
        out.expr, out._compiled, out._needs_body, out.also, out.unevaluable, out.waiting, out._scan_ns = (
            self.expr,
            self._compiled,
            self._needs_body,
            tags,
            0,
            self.waiting,
            0,
        )
        return out

    def begin_scan(self) -> None:
        self._scan_ns = 0

    def maybe(self, bloom: int) -> bool:
        return self.also is None or self.also.maybe(bloom)

    def full(self) -> bool:
        return len(self.waiting) >= UNEVALUABLE_KEPT_MAX or self._scan_ns > SCAN_EVAL_NS_MAX

    def matches_record(self, record: bytes | memoryview, pos: int = 0) -> bool:
        if self.also is not None and not self.also.matches_record(record, pos):
            return False
        began = time.monotonic_ns()
        try:
            m = decode_message(bytes(record), pos + RECORD_HEADER_BYTES)
            body = m.body if self._needs_body else None
            return truthy(evaluate(self._compiled, decode_properties(m.properties_raw), m.tags, body))
        except (RemoteProtocolError, UnevaluableError, ValueError) as exc:
            self.unevaluable += 1
            message = bytes(record[pos + RECORD_HEADER_BYTES :])
            self.waiting.append((message, f"the group's filter {self.expr!r} cannot evaluate it: {exc}"))
            if self.unevaluable == 1 or self.unevaluable % 1000 == 0:
                log.warning(
                    "filter %r cannot evaluate a message (%d so far), sent to the group's dead letters: %s",
                    self.expr,
                    self.unevaluable,
                    exc,
                )
            return False
        finally:
            self._scan_ns += time.monotonic_ns() - began


def dead_letter_unevaluable(store: Appending, subject: str, group: str, gf: GroupFilter) -> int:
    """Put the messages ``gf`` could not evaluate in ``group``'s dead letters of ``subject``, each
    with its reason; one that cannot be made a letter is logged and skipped. How many went."""
    if not gf.waiting:
        return 0
    # a scan repeated within one pull (after a consume-log repair: store/take.py) met them twice
    waiting = dict(gf.waiting)
    gf.waiting[:] = []
    dead_raw = dead_subject(subject, group).encode()
    letters: list[bytes] = []
    for message, reason in waiting.items():
        try:
            fields = HEADER.unpack_from(message, 0)
            props = decode_properties(decode_message(message).properties_raw)
            props[ERROR_PROPERTY] = reason[:1000]
            letter = with_times(
                message, min(fields[8], TIMES_MAX), subject=dead_raw, properties=encode_properties(props)
            )
            scan_batch(letter)
            letters.append(letter)
        except Exception as exc:  # one bad message never stops the others
            log.error(
                "a message group %r of %r filtered out cannot be dead-lettered (%s): skipped", group, subject, exc
            )
    if letters:
        body = b"".join(letters)
        result = store.append(body, scan_batch(body))
        if result.errors:
            log.error(
                "dead-lettering what the filter of %r of %r cannot evaluate: %s", group, subject, result.errors[:3]
            )
    return len(letters)
