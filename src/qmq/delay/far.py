"""Messages of far time buckets waiting for the next flush, and their sorting into buckets in bulk.

A batch spread over many buckets (a backlog over weeks: a message or two per bucket) would be
added to its buckets message by message, which costs more than writing them. So the messages
of buckets that cannot be loaded before the next flush wait here as they arrived (a slice of
the batch's records, with numpy arrays of their due times, sizes, ends and bucket starts), and
the flush takes them back as one run per bucket, in write-ahead log order: the entry numbers a
bucket gives them are the ones a replay of the log gives (a backlog over 30 days: store append
6.3 -> 2.8 us a message).

"Cannot be loaded before the next flush": starting later than ``preload_ms +
checkpoint_interval_ms`` and a margin after the first of them arrived (every checkpoint
flushes; loading a bucket flushes first anyway). That cut-off is fixed until the flush, so no
bucket takes some messages at once and earlier ones later.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from qmq.common.clock import Clock

# Beyond the preload window and a checkpoint interval: a checkpoint that runs a little late
# still flushes the waiting messages before their bucket can be loaded.
_MARGIN_MS = 60_000

Int64s = npt.NDArray[np.int64]


class FarRun(NamedTuple):
    """The waiting messages of one bucket, back to back in write-ahead log order."""

    start_ms: int
    records: bytes
    dues: Int64s
    sizes: Int64s
    wal_end: int  # end offset in the write-ahead log of the last of them
    id_hashes: npt.NDArray[np.uint32] | None  # of their ids (ids.py); None: read from the records


class _Waiting(NamedTuple):
    records: memoryview  # the batch's records, the waiting ones among them
    base: int  # where ``records`` start in the write-ahead log
    dues: Int64s
    sizes: Int64s
    ends: Int64s  # of each waiting record within ``records``
    starts: Int64s  # of each waiting record's bucket
    id_hashes: npt.NDArray[np.uint32] | None


class FarMessages:
    """Messages of buckets that start after ``from_ms``, waiting, in the order they arrived."""

    __slots__ = ("_clock", "_waiting", "from_ms", "margin_ms")

    def __init__(self, clock: Clock, preload_ms: int, checkpoint_interval_ms: int) -> None:
        self._clock = clock
        self.margin_ms = preload_ms + checkpoint_interval_ms + _MARGIN_MS
        self._waiting: list[_Waiting] = []
        # buckets starting after this wait; set by the first spread batch since the last flush
        self.from_ms: int | None = None

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def cutoff_ms(self) -> int:
        """Buckets starting after this wait: fixed from the first call after a flush until the next."""
        if self.from_ms is None:
            self.from_ms = self._clock.now_ms() + self.margin_ms
        return self.from_ms

    def add(
        self,
        records: memoryview,
        base: int,
        dues: Int64s,
        sizes: Int64s,
        ends: Int64s,
        starts: Int64s,
        id_hashes: npt.NDArray[np.uint32] | None = None,
    ) -> None:
        """Hold messages of a batch (``records`` from log offset ``base``; ``ends`` within ``records``)."""
        self._waiting.append(_Waiting(records, base, dues, sizes, ends, starts, id_hashes))

    def take_runs(self) -> Iterator[FarRun]:
        """Everything waiting, as one run per bucket in bucket order; the cut-off is reset."""
        waiting, self._waiting = self._waiting, []
        self.from_ms = None
        return _runs(waiting)


def _runs(waiting: list[_Waiting]) -> Iterator[FarRun]:
    if not waiting:
        return
    views = [w.records for w in waiting]
    offsets = np.cumsum([0] + [len(v) for v in views[:-1]])
    buf = memoryview(b"".join(views))
    # each message: where it ends in buf and in the log; sorted by bucket, log order kept
    ends = np.concatenate([w.ends + off for w, off in zip(waiting, offsets.tolist(), strict=True)])
    log_ends = np.concatenate([w.ends + w.base for w in waiting])
    dues = np.concatenate([w.dues for w in waiting])
    sizes = np.concatenate([w.sizes for w in waiting])
    starts = np.concatenate([w.starts for w in waiting])
    hashes = None
    if all(w.id_hashes is not None for w in waiting):
        hashes = np.concatenate([w.id_hashes for w in waiting if w.id_hashes is not None])
    order = np.argsort(starts, kind="stable")
    if hashes is not None:
        hashes = hashes[order]
    ends, log_ends, dues, sizes, starts = ends[order], log_ends[order], dues[order], sizes[order], starts[order]
    unique, first, counts = np.unique(starts, return_index=True, return_counts=True)
    ends_l, sizes_l = ends.tolist(), sizes.tolist()
    for start, i, k in zip(unique.tolist(), first.tolist(), counts.tolist(), strict=True):
        j = i + k
        run = b"".join([buf[e - z : e] for e, z in zip(ends_l[i:j], sizes_l[i:j], strict=True)])
        yield FarRun(start, run, dues[i:j], sizes[i:j], int(log_ends[j - 1]), None if hashes is None else hashes[i:j])
