"""The duplicate window: ids of recently stored messages, so a repeat is dropped.

Kept as a few generations of hash sets: a lookup checks each, a new generation begins every
quarter of the window (or quarter of the entry bound), and the oldest goes when it falls out
of the window or the bound is passed. So the window is "the last ``window_ms`` or the last
``entries_max`` ids, whichever is smaller", with memory bounded by ``entries_max`` plus
one generation (a quarter).

Keys are Python's 64-bit hash of the id bytes: a false match needs two ids with the same
64-bit hash inside one window (about 1 in 10^7 with a million ids). The hash is seeded per
process, so the window is rebuilt from the message log after a restart, never persisted.
"""

from __future__ import annotations

from collections import deque

_GENERATIONS = 4


class DedupWindow:
    def __init__(self, window_ms: int, entries_max: int) -> None:
        self.window_ms = window_ms
        self.entries_max = entries_max
        self._gen_ms = max(1, window_ms // _GENERATIONS)
        self._gen_entries = max(1, entries_max // _GENERATIONS)
        self._gens: deque[tuple[int, set[int]]] = deque()
        self._size = 0

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
