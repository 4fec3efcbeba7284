"""The duplicate window: keys of recently stored messages, so a repeat is dropped; and the
marks that say how far back the message log must be read to fill the window again.

A message's key (``dedup_key``) is Python's 64-bit hash of its id, its subject, its
attempt count (``times``) and its copy number (``copy``, of a repeating delay message): a
producer's retry or a delay server's repeated hand-over repeats all four, while a retry of a
failed message re-sends its id to a retry subject with a higher attempt count, and the copies
of a repeating message share their id but not their copy number: each a new message. A
false match needs two keys with the same 64-bit hash inside one window (about 1 in 10^7
with a million keys). The hash is seeded per process, so the window is rebuilt from the
message log after a restart, never persisted: each checkpoint adds a mark ``[time_ms,
message-log offset, messages stored so far]``, and recovery reads the log from the oldest
mark the window still reaches.

Kept as a few generations of hash sets: a lookup checks each, a new generation begins every
quarter of the window (or quarter of the entry bound), and the oldest goes when it falls out
of the window or the bound is passed. So the window is "the last ``window_ms`` or the last
``entries_max`` keys, whichever is smaller", with memory bounded by ``entries_max`` plus
one generation (a quarter).
"""

from __future__ import annotations

from collections import deque

from qmq.protocol.message import ScannedMessage

_GENERATIONS = 4
_MARKS_MAX = 1000


def dedup_key(sm: ScannedMessage) -> int:
    """What makes two sends the same message: its id, on the same subject, at the same attempt,
    the same copy of a repeating delay message."""
    return hash((sm.message_id, sm.subject, sm.times, sm.copy))


class DedupWindow:
    def __init__(self, window_ms: int, entries_max: int) -> None:
        self.window_ms = window_ms
        self.entries_max = entries_max
        self._gen_ms = max(1, window_ms // _GENERATIONS)
        self._gen_entries = max(1, entries_max // _GENERATIONS)
        self._gens: deque[tuple[int, set[int]]] = deque()
        self._size = 0
        # messages stored since the message log began (dead letters and held records too), and
        # the marks of the checkpoints still inside the window: [time_ms, log offset, total_messages]
        self.total_messages = 0
        self.marks: list[list[int]] = []

    @property
    def enabled(self) -> bool:
        return self.window_ms > 0 and self.entries_max > 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, key: int) -> bool:
        for _start, keys in reversed(self._gens):
            if key in keys:
                return True
        return False

    def add_many(self, keys: list[int], now_ms: int) -> None:
        if not self.enabled or not keys:
            return
        gens = self._gens
        if not gens or now_ms - gens[-1][0] >= self._gen_ms or len(gens[-1][1]) >= self._gen_entries:
            gens.append((now_ms, set()))
        current = gens[-1][1]
        before = len(current)
        current.update(keys)
        self._size += len(current) - before
        self.expire(now_ms)

    def expire(self, now_ms: int) -> None:
        gens = self._gens
        # gens[0] holds only ids older than gens[1]'s start: all gone once that start leaves the window
        while len(gens) > 1 and (now_ms - gens[1][0] >= self.window_ms or self._size > self.entries_max):
            self._size -= len(gens.popleft()[1])

    # -- rebuilding after a restart ----------------------------------------------------

    def mark(self, now_ms: int, log_offset: int) -> list[list[int]]:
        """Add a checkpoint's mark; returns the marks to keep in it (those the window still
        reaches, plus the one before them, at most ``_MARKS_MAX``)."""
        marks = self.marks
        marks.append([now_ms, log_offset, self.total_messages])
        window_start = now_ms - self.window_ms
        while len(marks) > 1 and (marks[1][0] <= window_start or len(marks) > _MARKS_MAX):
            marks.pop(0)
        return marks

    def restore(self, total_messages: int, marks: list[list[int]]) -> None:
        """Take a checkpoint's count and marks back."""
        self.total_messages = total_messages
        self.marks = [list(m) for m in marks]

    def rebuild_from(self, index_from: int) -> int:
        """The message-log offset to read from (besides ``index_from``, where indexing starts)
        to see the keys the window may still hold: the oldest mark within ``entries_max``."""
        if not self.enabled:
            return index_from
        for mark in self.marks:
            if self.total_messages - mark[2] <= self.entries_max:
                return min(index_from, mark[1])
        return index_from

    def begin_marks(self, now_ms: int, log_start: int) -> None:
        """With no checkpoint yet, the log's start bounds the rebuild until the first one."""
        if not self.marks:
            self.marks = [[now_ms, log_start, 0]]
