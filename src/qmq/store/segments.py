"""A log split into segment files named by their 20-digit zero-padded base offset.

Offsets are global byte positions in the log: the byte at offset ``o`` lives in the segment
with the largest base ``<= o``, at position ``o - base``. Segments are appended to, read with
``pread`` and deleted whole from the front; the last one can be cut (``truncate``) to remove
a torn tail found by recovery.

Each segment file begins with the header of ``file_header.py`` naming its kind and format
version (files written before headers have none); offsets never count it.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qmq.store.file_header import FileKind, header, read_head, write_all


@dataclass(slots=True, eq=False)
class Segment:
    base: int
    path: Path
    fd: int
    size: int  # bytes of data, the header not counted
    head: int  # bytes of the file's header: 16, or 0 in a file written before headers

    @property
    def end(self) -> int:
        return self.base + self.size


def cut_back(fd: int, size: int, exc: OSError) -> None:
    """Cut the file ``fd`` back to ``size`` after a write failed with ``exc``; when even that
    fails, an EIO error saying so: what the file holds is then unknown."""
    try:
        os.ftruncate(fd, size)
    except OSError as undo:
        raise OSError(errno.EIO, f"{exc}; and what was written could not be cut back: {undo}") from exc


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class SegmentedLog:
    """Append-only bytes over a directory of segment files with suffix ``suffix``."""

    def __init__(self, directory: Path, suffix: str, segment_bytes: int, kind: FileKind) -> None:
        self.directory = directory
        self.suffix = suffix
        self.kind = kind
        self.segment_bytes = segment_bytes
        directory.mkdir(parents=True, exist_ok=True)
        self.segments: list[Segment] = []
        # fds of segments rolled or deleted while a flush may still need them: closed by the flusher
        self.retired_fds: list[int] = []
        # a segment was created since the last flush: its directory entry is fsynced by the next one
        self._dir_unsynced = False
        for path in sorted(directory.glob(f"*{suffix}")):
            stem = path.name[: -len(suffix)]
            if len(stem) != 20 or not stem.isdigit():
                continue
            self.segments.append(self._open_segment(int(stem), path))
        if not self.segments:
            self._new_segment(0)

    @property
    def start(self) -> int:
        return self.segments[0].base

    @property
    def end(self) -> int:
        return self.segments[-1].end

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    def _open_segment(self, base: int, path: Path) -> Segment:
        fd = os.open(path, os.O_RDWR | os.O_APPEND)
        try:
            head = read_head(fd, path, self.kind)
            if head is None:  # created, but cut inside its header: it holds nothing yet
                os.ftruncate(fd, 0)
                write_all(fd, header(self.kind))
                head = len(header(self.kind))
            return Segment(base, path, fd, os.fstat(fd).st_size - head, head)
        except BaseException:
            os.close(fd)
            raise

    def _new_segment(self, base: int) -> Segment:
        path = self.directory / f"{base:020d}{self.suffix}"
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC, 0o644)
        head = header(self.kind)
        try:
            write_all(fd, head)
        except BaseException:
            os.close(fd)
            raise
        seg = Segment(base, path, fd, 0, len(head))
        self.segments.append(seg)
        # Not fsynced here, on the caller's thread: under a heavy write load a directory fsync
        # commits the file system's journal, hundreds of milliseconds. What is written to the
        # new segment is acknowledged only after a flush, which fsyncs the directory first.
        self._dir_unsynced = True
        return seg

    def roll_if_needed(self, incoming_bytes: int) -> None:
        """Begin a new segment when ``incoming_bytes`` would not fit the active one."""
        seg = self.active
        if seg.size and seg.size + incoming_bytes > self.segment_bytes:
            self.retired_fds.append(os.dup(seg.fd))
            self._new_segment(seg.end)

    def start_segment(self, base: int) -> None:
        """Begin a new segment at ``base`` (the end of the log), as a master did: a slave mirrors it."""
        if base != self.end:
            raise ValueError(f"a new segment must start at the log's end {self.end}, not {base}")
        if self.active.size:
            self.retired_fds.append(os.dup(self.active.fd))
            self._new_segment(base)

    def append(self, data: bytes | bytearray | memoryview, roll: bool = True) -> int:
        """Write ``data`` at the end; return its offset. On failure nothing is left half-written.

        ``roll=False`` (a slave) never begins a segment on its own: it follows the master's.
        """
        if roll:
            self.roll_if_needed(len(data))
        seg = self.active
        offset = seg.end
        try:
            written = os.write(seg.fd, data)
            if written != len(data):
                raise OSError(errno.ENOSPC, f"short write: {written} of {len(data)} bytes")
        except OSError as exc:
            cut_back(seg.fd, seg.head + seg.size, exc)
            raise
        seg.size += written
        return offset

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer if the log ends first); never crosses a segment end."""
        seg = self.segment_for(offset)
        if seg is None:
            return b""
        pos = offset - seg.base
        return os.pread(seg.fd, min(size, seg.size - pos), seg.head + pos)

    def segment_for(self, offset: int) -> Segment | None:
        segs = self.segments
        if offset < segs[0].base or offset >= segs[-1].end:
            return None
        lo, hi = 0, len(segs) - 1
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if segs[mid].base <= offset:
                lo = mid
            else:
                hi = mid - 1
        return segs[lo]

    def truncate(self, offset: int) -> int:
        """Cut the log at ``offset``: later bytes (and later segments) go. Returns bytes removed."""
        removed = 0
        while len(self.segments) > 1 and self.segments[-1].base > offset:
            seg = self.segments.pop()
            removed += seg.size
            os.close(seg.fd)
            seg.path.unlink()
        seg = self.active
        if offset < seg.end:
            keep = max(0, offset - seg.base)
            removed += seg.size - keep
            os.ftruncate(seg.fd, seg.head + keep)
            seg.size = keep
        return removed

    def delete_before(self, offset: int) -> list[Segment]:
        """Delete whole segments that end at or before ``offset`` (never the active one)."""
        gone: list[Segment] = []
        while len(self.segments) > 1 and self.segments[0].end <= offset:
            seg = self.segments.pop(0)
            self.retired_fds.append(seg.fd)
            seg.path.unlink()
            gone.append(seg)
        return gone

    def sync_fds(self) -> list[int]:
        """fds a flush must fsync: the directory if a segment was created since the last flush,
        any segment rolled since, and the active one."""
        fds, self.retired_fds = self.retired_fds, []
        if self._dir_unsynced:
            self._dir_unsynced = False
            fds.insert(0, os.open(self.directory, os.O_RDONLY))
        fds.append(os.dup(self.active.fd))
        return fds

    def close(self) -> None:
        for seg in self.segments:
            os.close(seg.fd)
        for fd in self.retired_fds:
            os.close(fd)
        self.segments = []
        self.retired_fds = []


class FlushTicket:
    """fsync work captured on the loop thread; ``run`` may execute on any thread.

    ``on_error`` is told of a failed fsync (on the thread that ran it) before ``run`` raises it.
    """

    __slots__ = ("fds", "offset", "on_error")

    def __init__(self, fds: list[int], offset: int, on_error: Callable[[OSError], None] | None = None) -> None:
        self.fds = fds
        self.offset = offset
        self.on_error = on_error

    def run(self) -> None:
        try:
            for fd in self.fds:
                if stat.S_ISDIR(os.fstat(fd).st_mode):
                    os.fsync(fd)  # a new entry: fdatasync need not commit it
                else:
                    os.fdatasync(fd)
        except OSError as exc:
            if self.on_error is not None:
                self.on_error(exc)
            raise
        finally:
            for fd in self.fds:
                os.close(fd)
