"""Which sequence numbers have arrived, counted once, across one or several consumer
processes of the same cell.

Several processes share one memory-mapped file the driver creates; its layout:

    0                      members × 32 bytes                 + expected bytes
    +----------------------+-----------------------------------+
    | slot per member:     | seen[seq]: 1 once any member has  |
    | unique, duplicates,  | received seq                      |
    | first_ns, last_ns    |                                   |
    | (u64 each)           |                                   |
    +----------------------+-----------------------------------+

A member stops when the sum of all members' `unique` reaches `expected`, so a drain by
several competing consumers ends as soon as the backlog is gone, without idle timeouts.
Two members marking the same seq at the same instant could both count it; that race
needs a duplicate delivery in the first place and is reported as such anyway.
"""

from __future__ import annotations

import mmap
import os
import struct

SLOT = struct.Struct("<QQQQ")


def tally_bytes(expected: int, members: int) -> int:
    return members * SLOT.size + expected


def create_tally_file(path: str, expected: int, members: int) -> None:
    with open(path, "wb") as f:
        f.truncate(tally_bytes(expected, members))


class Tally:
    def __init__(self, expected: int, members: int = 1, index: int = 0, path: str | None = None) -> None:
        self.expected = expected
        self.members = members
        self.index = index
        self._slot_at = index * SLOT.size
        self._seen_at = members * SLOT.size
        if path is None:
            self._buf: bytearray | mmap.mmap = bytearray(tally_bytes(expected, members))
        else:
            fd = os.open(path, os.O_RDWR)
            try:
                self._buf = mmap.mmap(fd, tally_bytes(expected, members))
            finally:
                os.close(fd)
        self.unique = 0
        self.duplicates = 0
        self.first_ns = 0
        self.last_ns = 0

    def record(self, seq: int, now_ns: int) -> bool:
        """Mark seq received at now_ns (CLOCK_MONOTONIC); False if it was a duplicate or out of range."""
        if seq >= self.expected:
            self.duplicates += 1
            return False
        at = self._seen_at + seq
        if self._buf[at]:
            self.duplicates += 1
            return False
        self._buf[at] = 1
        self.unique += 1
        if not self.first_ns:
            self.first_ns = now_ns
        self.last_ns = now_ns
        return True

    def publish(self) -> None:
        """Make this member's counts visible to the others."""
        SLOT.pack_into(self._buf, self._slot_at, self.unique, self.duplicates, self.first_ns, self.last_ns)

    def total_unique(self) -> int:
        if self.members == 1:
            return self.unique
        return sum(SLOT.unpack_from(self._buf, i * SLOT.size)[0] for i in range(self.members))

    def done(self) -> bool:
        return self.total_unique() >= self.expected

    def close(self) -> None:
        if isinstance(self._buf, mmap.mmap):
            self._buf.close()
