"""Messages stored ahead of their due time, released into their subjects once due.

A send may carry messages due a moment from now (a delay server hands them over shortly before
they are due; a producer sends those due within ``qmq.common.limits.HOLD_UNTIL_DUE_MS``). The
broker writes each as a *held record*: an ordinary message-log record whose sequence is
``HELD_SEQUENCE``, fsynced and replicated with its send like any other, but in no consume log,
so no pull can reach it. Once due, the master appends a copy of it to its subject — that copy
is what consumers receive. Since the held record is already on disk, the copy needs no fsync
before it is visible: recovery (or a slave) finds held records without a copy after them and
releases them again, so a crash, even a power loss, loses none (a power loss may deliver one
twice).

This module keeps the held records not yet released: a heap by due time for the master's
release timer, and by duplicate key for recovery and slaves, which see copies as records.
"""

from __future__ import annotations

import heapq
from typing import NamedTuple

HELD_SEQUENCE = (1 << 64) - 1


class Held(NamedTuple):
    due_ms: int
    offset: int
    size: int  # the whole record, header included
    key: int  # the duplicate key of its message


class HeldMessages:
    def __init__(self) -> None:
        self._heap: list[tuple[int, int]] = []  # (due_ms, offset); entries released meanwhile stay until popped
        self._live: dict[int, Held] = {}  # by offset
        self._by_key: dict[int, list[int]] = {}  # offsets, oldest first (one, unless dedup is off)
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._live)

    def add(self, held: Held) -> None:
        self._live[held.offset] = held
        self._by_key.setdefault(held.key, []).append(held.offset)
        heapq.heappush(self._heap, (held.due_ms, held.offset))
        self.bytes += held.size

    def copied(self, key: int) -> None:
        """A copy with this key was stored: the oldest held record with it is released."""
        offsets = self._by_key.get(key)
        if offsets:
            self._forget(self._live[offsets[0]])

    def _forget(self, held: Held) -> None:
        del self._live[held.offset]
        offsets = self._by_key[held.key]
        offsets.remove(held.offset)
        if not offsets:
            del self._by_key[held.key]
        self.bytes -= held.size

    def next_due_ms(self) -> int | None:
        heap, live = self._heap, self._live
        while heap and heap[0][1] not in live:
            heapq.heappop(heap)
        return heap[0][0] if heap else None

    def take_due(self, now_ms: int, max_n: int) -> list[Held]:
        """Up to ``max_n`` held records due by ``now_ms``, in due order; they are forgotten."""
        heap, live = self._heap, self._live
        out: list[Held] = []
        while heap and len(out) < max_n and heap[0][0] <= now_ms:
            _due, offset = heapq.heappop(heap)
            held = live.get(offset)
            if held is not None:
                self._forget(held)
                out.append(held)
        return out

    def snapshot(self) -> list[list[int]]:
        """For the checkpoint: [due_ms, offset, size] of each, in offset order (keys are hashes
        of this process: recovery computes them again from the records)."""
        return [[h.due_ms, h.offset, h.size] for h in sorted(self._live.values(), key=lambda h: h.offset)]
