"""The delay store's checkpoint: its contents, their format version, and the job that writes it.

It is the file ``checkpoint`` in the data directory, written by ``qmq.store.checkpoint`` (a
msgpack map behind a magic and a CRC32C, replaced atomically). This module is the one home of
the map's contents; format version 1, keys in this order::

    version       int    1
    time_ms       int    when it was captured (epoch ms)
    wal_offset    int    the write-ahead log offset the schedule logs cover: recovery replays from it
    wal_messages  int    records in the write-ahead log before ``wal_offset`` (the next sequence)
    bucket_ms     int    the time bucket length when it was written
    buckets       array  one [start_ms, bytes, entries, min_due_ms, wal_end] per bucket, in time order

    start_ms      the bucket's start (epoch ms): its directory under ``schedule/``
    bytes         bytes of its ``messages`` file the checkpoint covers (fsynced before it was written)
    entries       entries of its ``index`` file the checkpoint covers
    min_due_ms    the earliest due time among those entries
    wal_end       end offset of the last write-ahead log record replayed into it

Recovery cuts each bucket back to its ``bytes`` and ``entries`` (recovery.py). The version is
written but not checked on reading: a new layout needs a new version here and a migration.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

from qmq.delay.bucket import Bucket, fsync_paths
from qmq.store.checkpoint import read_checkpoint, write_checkpoint

FORMAT_VERSION = 1


class BucketMark(NamedTuple):
    """What a checkpoint keeps of one bucket (a row of ``buckets``, fields in this order)."""

    start_ms: int
    nbytes: int
    entries: int
    min_due_ms: int
    wal_end: int

    @classmethod
    def of(cls, b: Bucket) -> BucketMark:
        """The bucket as written so far (what is still buffered is not covered)."""
        return cls(b.start_ms, b.flushed_bytes, b.flushed_count, b.min_due_ms, b.wal_end)


@dataclass(frozen=True, slots=True)
class DelayCheckpoint:
    time_ms: int
    wal_offset: int
    wal_messages: int
    bucket_ms: int | None  # None: a checkpoint that did not say
    buckets: list[BucketMark]

    def to_state(self) -> dict[str, Any]:
        return {
            "version": FORMAT_VERSION,
            "time_ms": self.time_ms,
            "wal_offset": self.wal_offset,
            "wal_messages": self.wal_messages,
            "bucket_ms": self.bucket_ms,
            "buckets": [list(m) for m in self.buckets],
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DelayCheckpoint:
        bucket_ms = state.get("bucket_ms")
        return cls(
            int(state.get("time_ms", 0)),
            int(state["wal_offset"]),
            int(state["wal_messages"]),
            None if bucket_ms is None else int(bucket_ms),
            [BucketMark(*(int(x) for x in row)) for row in state["buckets"]],
        )


def read_delay_checkpoint(directory: Path) -> DelayCheckpoint | None:
    """The checkpoint in ``directory``; None when there is none or it is damaged."""
    state = read_checkpoint(directory)
    return None if state is None else DelayCheckpoint.from_state(state)


class CheckpointJob:
    """A checkpoint captured on the loop; ``run`` fsyncs and writes it on a worker thread.

    ``on_sync_error`` is told (on that thread) of a failed fsync of a schedule log before ``run``
    raises it: what that file holds is then unknown, and no later checkpoint may name it.
    """

    __slots__ = ("checkpoint", "directory", "on_sync_error", "paths")

    def __init__(
        self,
        directory: Path,
        paths: list[Path],
        checkpoint: DelayCheckpoint,
        on_sync_error: Callable[[OSError], None] | None = None,
    ) -> None:
        self.directory = directory
        self.paths = paths  # schedule-log files (and directories) the checkpoint names: fsynced first
        self.checkpoint = checkpoint
        self.on_sync_error = on_sync_error

    @property
    def wal_offset(self) -> int:
        return self.checkpoint.wal_offset

    def run(self) -> None:
        try:
            fsync_paths(self.paths)
        except OSError as exc:
            if self.on_sync_error is not None:
                self.on_sync_error(exc)
            raise
        write_checkpoint(self.directory, self.checkpoint.to_state())
