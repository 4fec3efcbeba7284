"""A delay slave behind its master's retained write-ahead log copies the master's schedule anew.

A master deletes write-ahead log segments once a checkpoint covers them, keeping for its slaves
only what they were seen copying within the last hour (store.py). A slave down longer asks
from an offset the master no longer has: it would never get the messages those segments held.
So the master answers such a request ``behind`` (with where its log starts now), and the slave
copies the master's state as its last checkpoint names it instead:

1. ``{"part": "checkpoint"}``: the master's checkpoint (checkpoint.py: the write-ahead log
   offset W its schedule logs cover, and each bucket's marks);
2. ``{"part": "file", "bucket": S, "name": "messages" | "index", "offset": k, "end": e}``: bytes
   ``[k, e)`` of a bucket's file, at most a replication chunk an answer, for every bucket the
   checkpoint names, up to its marks (what the checkpoint covers is fsynced and never changes
   while the bucket lives; a bucket finished and deleted meanwhile is answered ``gone``, and
   left out: all of it was handed over);
3. the slave then swaps that copy in for its own schedule (``DelayStore.install_copy``): its
   buckets are the master's as the checkpoint names them, its write-ahead log begins empty at W,
   and it copies the master's log from W as any slave does; the dispatch logs come whole with
   the next answers (a copy of unknown token asks for them from their start: replica.py).

Until the swap, the slave reports no replication time to the meta server (``resyncing``), so it
is never promoted with half a copy, and it keeps asking from its old offset, so the master
deletes nothing more meanwhile. The copy is staged in ``<data_dir>/resync/`` and swapped in
behind a marker file: a crash during the swap leaves the marker, and the next start begins from
an empty store (which is behind again, and copies anew).

Synchronous; runs on the server's event loop.
"""

from __future__ import annotations

import logging
import os
from collections import deque
from pathlib import Path
from typing import Any

from qmq.delay.bucket import INDEX, INDEX_ENTRY_BYTES, MESSAGES, bucket_dir_name
from qmq.delay.checkpoint import DelayCheckpoint, read_delay_checkpoint
from qmq.store import fileio
from qmq.store.replica import ReplicaError

log = logging.getLogger(__name__)

STAGING_DIR = "resync"
_FILES = (MESSAGES, INDEX)


def behind_answer(token: int, start: int) -> dict[str, Any]:
    """The master's answer to a request from before its log's start ``start``."""
    return {"behind": start, "token": token, "offset": start, "segment_base": start, "count": 0, "dispatch": []}


def read_part(data_dir: Path, schedule_dir: Path, ask: dict[str, Any], budget: int) -> tuple[dict[str, Any], bytes]:
    """The master's answer to one part of a copy anew: ``snapshot`` fields and the bytes."""
    part = ask.get("part")
    if part == "checkpoint":
        checkpoint = read_delay_checkpoint(data_dir)
        if checkpoint is None:
            raise ReplicaError("this master has no checkpoint to copy anew from yet; ask again after its next one")
        return {"checkpoint": checkpoint.to_state()}, b""
    if part != "file":
        raise ReplicaError(f"unknown part {part!r} of a copy anew: expected checkpoint or file")
    start, name, offset, end = ask.get("bucket"), ask.get("name"), ask.get("offset"), ask.get("end")
    if not (isinstance(start, int) and name in _FILES and isinstance(offset, int) and isinstance(end, int)):
        raise ReplicaError(f"a file part of a copy anew needs bucket, name (messages or index), offset and end: {ask}")
    fields: dict[str, Any] = {"bucket": start, "name": name, "offset": offset}
    path = schedule_dir / bucket_dir_name(start) / str(name)
    try:
        fd = fileio.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return {**fields, "gone": True}, b""
    try:
        data = fileio.pread(fd, max(0, min(budget, end - offset)), offset)
    finally:
        fileio.close(fd)
    return fields, data


class Resync:
    """The slave's side: what to ask next, and the copy staged under ``<data_dir>/resync``."""

    def __init__(self, data_dir: Path, behind: int) -> None:
        self.staging = data_dir / STAGING_DIR
        self.behind = behind  # where the master's log began when it said this copy was behind
        remove_tree(self.staging)
        fileio.make_dirs(self.staging / "schedule")
        self.checkpoint: DelayCheckpoint | None = None
        self._todo: deque[tuple[int, str, int]] = deque()  # (bucket start, file, bytes to copy)
        self._at = 0  # bytes of the first file of _todo copied
        self.copied_bytes = 0

    @property
    def done(self) -> bool:
        return self.checkpoint is not None and not self._todo

    def ask(self) -> dict[str, Any]:
        if self.checkpoint is None:
            return {"part": "checkpoint"}
        start, name, size = self._todo[0]
        return {"part": "file", "bucket": start, "name": name, "offset": self._at, "end": size}

    def take(self, fields: dict[str, Any], body: bytes) -> None:
        if "checkpoint" in fields:
            if self.checkpoint is None:
                self._begin(DelayCheckpoint.from_state(fields["checkpoint"]))
            return
        if self.checkpoint is None or not self._todo:
            return  # a stale answer
        start, name, size = self._todo[0]
        if (fields.get("bucket"), fields.get("name"), fields.get("offset")) != (start, name, self._at):
            return  # not the part asked for last: asked again
        directory = self.staging / "schedule" / bucket_dir_name(start)
        if fields.get("gone"):
            # finished and deleted on the master since its checkpoint: every message handed over
            remove_tree(directory)
            marks = [m for m in self.checkpoint.buckets if m.start_ms != start]
            self.checkpoint = DelayCheckpoint(
                self.checkpoint.time_ms,
                self.checkpoint.wal_offset,
                self.checkpoint.wal_messages,
                self.checkpoint.bucket_ms,
                marks,
            )
            while self._todo and self._todo[0][0] == start:
                self._todo.popleft()
            self._at = 0
            return
        if not body and self._at < size:
            raise ReplicaError(f"the master's {name} of time bucket {start} ends before {size} bytes")
        fd = fileio.open(directory / name, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        try:
            fileio.write_all(fd, body)
        finally:
            fileio.close(fd)
        self._at += len(body)
        self.copied_bytes += len(body)
        if self._at >= size:
            self._todo.popleft()
            self._at = 0

    def _begin(self, checkpoint: DelayCheckpoint) -> None:
        self.checkpoint = checkpoint
        for m in checkpoint.buckets:
            fileio.make_dirs(self.staging / "schedule" / bucket_dir_name(m.start_ms))
            for name, size in ((MESSAGES, m.nbytes), (INDEX, m.entries * INDEX_ENTRY_BYTES)):
                if size:
                    self._todo.append((m.start_ms, name, size))
        log.warning(
            "copying the master's schedule anew from its checkpoint at write-ahead log offset %d: %d bucket(s)",
            checkpoint.wal_offset,
            len(checkpoint.buckets),
        )


def remove_tree(path: Path) -> None:
    """Delete a directory and what it holds (the staging area, a bucket staged, a store wiped)."""
    try:
        names = fileio.listdir(path)
    except (FileNotFoundError, NotADirectoryError):
        return
    for name in names:  # bounded: a store's directories are two levels deep
        child = path / name
        if child.is_dir():
            remove_tree(child)
        else:
            fileio.unlink(child, missing_ok=True)
    fileio.rmdir(path)
