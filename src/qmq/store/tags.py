"""Tag filters of consumer groups, applied on the broker: a bloom test on the consume-log
entry first (no read), then an exact test of the tags in the record for what passes.

Each tag sets two bits of a 64-bit bloom (``consume_log.tag_bits``). "or": a message matches
when it carries any of the tags; "and": when it carries all of them. A subscription without
tags matches every message and needs no filter.
"""

from __future__ import annotations

from typing import Protocol

from qmq.protocol.message import HEADER, HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store.consume_log import tag_bits

TAG_TYPES = ("or", "and")


class RecordFilter(Protocol):
    """What the store's scan asks of a filter: a tag filter, or a group's (qmq.store.group_filter)."""

    def maybe(self, bloom: int) -> bool: ...

    def matches_record(self, record: bytes | memoryview, pos: int = 0) -> bool: ...

    def full(self) -> bool:
        """True when the scan must stop after the record just tested: a group's filter holds as
        many messages it could not evaluate as it may until they are dead-lettered (after the
        pull), or spent its time of this scan (qmq.store.group_filter)."""
        ...


class TagFilter:
    __slots__ = ("all_bits", "bits", "mode", "tags")

    def __init__(self, tags: list[str], mode: str) -> None:
        if mode not in TAG_TYPES:
            raise ValueError(f"tag_type {mode!r} is not allowed; use 'or' or 'and'")
        self.tags = frozenset(t.encode("utf-8") for t in tags)
        self.mode = mode
        self.bits = [tag_bits(t) for t in self.tags]
        self.all_bits = 0
        for b in self.bits:
            self.all_bits |= b

    def maybe(self, bloom: int) -> bool:
        """False only when the message certainly does not match."""
        if self.mode == "and":
            return bloom & self.all_bits == self.all_bits
        for b in self.bits:
            if bloom & b == b:
                return True
        return False

    def full(self) -> bool:
        return False

    def matches_record(self, record: bytes | memoryview, pos: int = 0) -> bool:
        """Exact test on a stored record at ``record[pos:]``."""
        m = pos + RECORD_HEADER_BYTES
        _v, _f, slen, ilen, tcount, tlen, *_rest = HEADER.unpack_from(record, m)
        if not tcount:
            return False
        p = m + HEADER_BYTES + slen + ilen
        end = p + tlen
        carried = set()
        while p < end:
            n = record[p]
            carried.add(bytes(record[p + 1 : p + 1 + n]))
            p += 1 + n
        if self.mode == "and":
            return self.tags <= carried
        return not self.tags.isdisjoint(carried)
