"""The in-memory timer: the messages of loaded time buckets, as compact arrays sorted by due time.

One row per message (a numpy structured array, 32 bytes a row, no Python object per message)::

    due     i64  when it is due (epoch ms)
    bucket  i64  start of its time bucket (epoch ms): which schedule log holds it
    offset  u64  where its record starts in that schedule log's ``messages`` file
    entry   u32  its entry number in the bucket's ``index`` (what the dispatch log records)
    size    u32  bytes of its record

Rows live in two runs, each sorted by due: the *main* run, built when buckets are loaded, and
a small *late* run of rows added since (messages that arrived for a loaded bucket). Added
batches first wait, unsorted, in an *incoming* list (only their earliest due time is kept
up to date); they are sorted and merged into the late run once ``incoming_rows_max`` rows
wait or one of them is due, so a stream of small batches does not copy the late run once
per batch. When the late run passes ``late_rows_max`` it is merged into the main run, so
adding stays cheap and firing is a comparison of heads. Taking rows only advances a head;
the taken prefix is dropped when it is more than half of a run. Equal due times keep the
order they were added in.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt

ROW = np.dtype([("due", "<i8"), ("bucket", "<i8"), ("offset", "<u8"), ("entry", "<u4"), ("size", "<u4")])
ROW_BYTES = ROW.itemsize  # 32

Rows = npt.NDArray[Any]  # a 1-d array of ROW

_LATE_ROWS_MAX = 16_384
_INCOMING_ROWS_MAX = 4_096
_COMPACT_ROWS_MIN = 4_096


def empty_rows() -> Rows:
    return np.empty(0, dtype=ROW)


def make_rows(
    bucket_start_ms: int,
    dues: npt.NDArray[Any],
    offsets: npt.NDArray[Any],
    entries: npt.NDArray[Any],
    sizes: npt.NDArray[Any],
) -> Rows:
    """Rows of messages of one bucket, from arrays of their fields (in the order given)."""
    rows = np.empty(len(dues), dtype=ROW)
    rows["due"] = dues
    rows["bucket"] = bucket_start_ms
    rows["offset"] = offsets
    rows["entry"] = entries
    rows["size"] = sizes
    return rows


def sort_rows(rows: Rows) -> Rows:
    """``rows`` sorted by due time, keeping the order of equal ones."""
    if len(rows) < 2:
        return rows
    return rows[np.argsort(rows["due"], kind="stable")]


def merge_rows(a: Rows, b: Rows) -> tuple[Rows, npt.NDArray[np.intp]]:
    """Merge two runs sorted by due (``a``'s rows first among equals); also where ``b``'s rows went."""
    if not len(b):
        return a, np.empty(0, dtype=np.intp)
    if not len(a):
        return b, np.arange(len(b), dtype=np.intp)
    at_b = np.searchsorted(a["due"], b["due"], side="right") + np.arange(len(b), dtype=np.intp)
    out = np.empty(len(a) + len(b), dtype=ROW)
    from_a = np.ones(len(out), dtype=bool)
    from_a[at_b] = False
    out[at_b] = b
    out[from_a] = a
    return out, at_b


class Timer:
    """Rows of due messages, taken in due order; bounded only by what the loaded buckets hold."""

    def __init__(self, late_rows_max: int = _LATE_ROWS_MAX, incoming_rows_max: int = _INCOMING_ROWS_MAX) -> None:
        self.late_rows_max = late_rows_max
        self.incoming_rows_max = incoming_rows_max
        self._main = empty_rows()
        self._main_head = 0
        self._late = empty_rows()
        self._late_head = 0
        self._incoming: list[Rows] = []
        self._incoming_rows = 0
        self._incoming_min: int | None = None

    def __len__(self) -> int:
        return len(self._main) - self._main_head + len(self._late) - self._late_head + self._incoming_rows

    @property
    def nbytes(self) -> int:
        """Bytes the arrays hold (taken prefixes not yet dropped included)."""
        return int(self._main.nbytes + self._late.nbytes + sum(r.nbytes for r in self._incoming))

    def add(self, rows: Rows) -> None:
        """Add rows in any order (a batch of arrivals, or rows handed back after a failed hand-over)."""
        if not len(rows):
            return
        self._incoming.append(rows)
        self._incoming_rows += len(rows)
        first = int(rows["due"].min())
        if self._incoming_min is None or first < self._incoming_min:
            self._incoming_min = first
        if self._incoming_rows >= self.incoming_rows_max:
            self._merge_incoming()

    def _merge_incoming(self) -> None:
        if not self._incoming:
            return
        incoming = self._incoming[0] if len(self._incoming) == 1 else np.concatenate(self._incoming)
        self._incoming, self._incoming_rows, self._incoming_min = [], 0, None
        late, _ = merge_rows(self._late[self._late_head :], sort_rows(incoming))
        self._late, self._late_head = late, 0
        if len(late) > self.late_rows_max:
            self._merge_late()

    def add_sorted_main(self, rows: Rows) -> None:
        """Add a large run already sorted by due (a bucket just loaded) straight to the main run."""
        main, _ = merge_rows(self._main[self._main_head :], rows)
        self._main, self._main_head = main, 0

    def _merge_late(self) -> None:
        main, _ = merge_rows(self._main[self._main_head :], self._late[self._late_head :])
        self._main, self._main_head = main, 0
        self._late, self._late_head = empty_rows(), 0

    def next_due(self) -> int | None:
        """The earliest due time held, or None when empty."""
        best: int | None = None
        if self._main_head < len(self._main):
            best = int(self._main["due"][self._main_head])
        if self._late_head < len(self._late):
            d = int(self._late["due"][self._late_head])
            if best is None or d < best:
                best = d
        d_in = self._incoming_min
        if d_in is not None and (best is None or d_in < best):
            best = d_in
        return best

    def take(self, now_ms: int, rows_max: int) -> Rows:
        """Remove and return up to ``rows_max`` rows due at or before ``now_ms``, earliest first."""
        if self._incoming_min is not None and self._incoming_min <= now_ms:
            self._merge_incoming()
        a = self._due_prefix(self._main, self._main_head, now_ms, rows_max)
        b = self._due_prefix(self._late, self._late_head, now_ms, rows_max)
        if not len(b):
            self._main_head += len(a)
            out = a.copy()
        elif not len(a):
            self._late_head += len(b)
            out = b.copy()
        else:
            merged, at_b = merge_rows(a, b)
            taken_b = int(np.count_nonzero(at_b < rows_max))
            out = merged[:rows_max].copy()
            self._main_head += len(out) - taken_b
            self._late_head += taken_b
        self._compact()
        return out

    @staticmethod
    def _due_prefix(run: Rows, head: int, now_ms: int, rows_max: int) -> Rows:
        window = run[head : head + rows_max]
        if not len(window) or window["due"][0] > now_ms:
            return window[:0]
        return window[: int(np.searchsorted(window["due"], now_ms, side="right"))]

    def _compact(self) -> None:
        if self._main_head >= _COMPACT_ROWS_MIN and self._main_head * 2 >= len(self._main):
            self._main, self._main_head = self._main[self._main_head :].copy(), 0
        if self._late_head >= _COMPACT_ROWS_MIN and self._late_head * 2 >= len(self._late):
            self._late, self._late_head = self._late[self._late_head :].copy(), 0

    def rows_of(self, bucket_start_ms: int) -> Rows:
        """The rows held for one bucket (for stats; O(rows))."""
        self._merge_incoming()
        parts = [self._main[self._main_head :], self._late[self._late_head :]]
        return np.concatenate([p[p["bucket"] == bucket_start_ms] for p in parts])

    def drop_bucket(self, bucket_start_ms: int) -> int:
        """Remove every row of one bucket; returns how many there were."""
        self._merge_incoming()
        removed = 0
        for name in ("_main", "_late"):
            head_name = name + "_head"
            run = getattr(self, name)[getattr(self, head_name) :]
            keep = run["bucket"] != bucket_start_ms
            removed += len(run) - int(np.count_nonzero(keep))
            setattr(self, name, run[keep])
            setattr(self, head_name, 0)
        return removed
