"""A log split into segment files named by their 20-digit zero-padded base offset.

Offsets are global byte positions in the log: the byte at offset ``o`` lives in the segment
with the largest base ``<= o``, at position ``o - base``. Segments are appended to, read with
``pread`` and deleted whole from the front; the last one can be cut (``truncate``) to remove
a torn tail found by recovery.

Each segment file begins with the header of ``file_header.py`` naming its kind and format
version (files written before headers have none); offsets never count it.

A log keeps its segment files open (the message log, the action log: few files, each fsynced
by the flush that follows its writes, ``sync_fds``), or, given an ``OpenFiles``, lets it open
and close them within its bound (consume logs: many files, made durable by a checkpoint's
``syncfs`` instead).
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from qmq.store import fileio
from qmq.store.file_header import FileKind, header, read_head
from qmq.store.fileio import StrPath, fsync_dir, syncfs
from qmq.store.open_files import OpenFiles

__all__ = ["FlushTicket", "Segment", "SegmentedLog", "cut_back", "fsync_dir", "segment_base", "syncfs"]

_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)


def segment_base(name: str, suffix: str) -> int | None:
    """The base offset a segment file's ``name`` (20 digits, then ``suffix``) says; None for
    any other name."""
    stem = name[: -len(suffix)]
    if not name.endswith(suffix) or len(stem) != 20 or not stem.isdigit():
        return None
    return int(stem)


@dataclass(slots=True, eq=False)
class Segment:
    base: int
    path: str  # a str, not a Path: one segment or more per subject, and a Path costs ~300 bytes more
    fd: int  # -1 while its OpenFiles has it closed
    size: int  # bytes of data, the header not counted
    head: int  # bytes of the file's header: 16, or 0 in a file written before headers

    @property
    def end(self) -> int:
        return self.base + self.size


def cut_back(fd: int, size: int, exc: OSError) -> None:
    """Cut the file ``fd`` back to ``size`` after a write failed with ``exc``; when even that
    fails, an EIO error saying so: what the file holds is then unknown."""
    try:
        fileio.ftruncate(fd, size)
    except OSError as undo:
        raise OSError(errno.EIO, f"{exc}; and what was written could not be cut back: {undo}") from exc


def _dup_or_sync(fd: int, sync: Callable[[int], None]) -> int | None:
    """A duplicate of ``fd`` for a flush to sync and close; with no descriptor free, ``fd`` is
    synced here and now (blocking, but a flush never fails for want of a descriptor)."""
    try:
        return fileio.dup(fd)
    except OSError as exc:
        if exc.errno not in _OUT_OF_FILES:
            raise
    sync(fd)
    return None


class SegmentedLog:
    """Append-only bytes over a directory of segment files with suffix ``suffix``; see the
    module docstring for ``files``."""

    # one per subject (its consume log): slots and a str directory keep an idle one small
    __slots__ = (
        "_dir", "_dir_fd", "_dir_unsynced", "files", "kind", "retired_fds", "segment_bytes", "segments", "suffix"
    )

    def __init__(
        self,
        directory: StrPath,
        suffix: str,
        segment_bytes: int,
        kind: FileKind,
        files: OpenFiles | None = None,
        names: list[str] | None = None,
    ) -> None:
        """``names``: what ``directory`` holds, when the caller knows (it just made it: nothing;
        or it listed it); otherwise it is listed here (and made if it is not there)."""
        self._dir = str(directory)
        self.suffix = suffix
        self.kind = kind
        self.segment_bytes = segment_bytes
        self.files = files
        if names is None:
            try:
                names = fileio.listdir(directory)
            except FileNotFoundError:
                names = []
                fileio.make_dirs(directory)
        names = sorted(names)
        self.segments: list[Segment] = []
        # the directory, held open so that a flush can always fsync it
        self._dir_fd = -1 if files is not None else fileio.open(directory, os.O_RDONLY)
        # fds of segments rolled or deleted while a flush may still need them: closed by the flusher
        self.retired_fds: list[int] = []
        # a segment was created since the last flush: its directory entry is fsynced by the next one
        self._dir_unsynced = False
        try:
            for name in names:
                base = segment_base(name, suffix)
                if base is not None:
                    self.segments.append(self._open_segment(base, f"{self._dir}/{name}"))
            if not self.segments:
                self._new_segment(0)
        except BaseException:
            self.close()
            raise

    @property
    def directory(self) -> Path:
        return Path(self._dir)

    @property
    def start(self) -> int:
        return self.segments[0].base

    @property
    def end(self) -> int:
        return self.segments[-1].end

    @property
    def active(self) -> Segment:
        return self.segments[-1]

    def _fd(self, seg: Segment) -> int:
        """``seg``'s descriptor, for one call: with ``files``, any later ``_fd`` may close it."""
        return seg.fd if self.files is None else self.files.fd(seg)

    def _open_segment(self, base: int, path: str) -> Segment:
        seg = Segment(base, path, -1, 0, 0)
        if self.files is None:
            seg.fd = fileio.open(path, os.O_RDWR | os.O_APPEND)
        else:
            self.files.fd(seg)
        try:
            head = read_head(seg.fd, path, self.kind)
            if head is None:  # created, but cut inside its header: it holds nothing yet
                fileio.ftruncate(seg.fd, 0)
                fileio.write_all(seg.fd, header(self.kind))
                head = len(header(self.kind))
            seg.head = head
            seg.size = fileio.size(seg.fd) - head
            return seg
        except BaseException:
            self._close(seg)
            raise

    def _new_segment(self, base: int) -> Segment:
        path = f"{self._dir}/{base:020d}{self.suffix}"
        seg = Segment(base, path, -1, 0, len(header(self.kind)))

        def create() -> int:
            return fileio.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)

        if self.files is None:
            seg.fd = create()
        else:
            self.files.opened(seg, create)
        try:
            fileio.write_all(seg.fd, header(self.kind))
        except BaseException:
            self._close(seg)
            raise
        self.segments.append(seg)
        if self.files is not None:
            self.files.unsynced = True
        # Not fsynced here, on the caller's thread: under a heavy write load a directory fsync
        # commits the file system's journal, hundreds of milliseconds. What is written to the
        # new segment is acknowledged only after a flush, which fsyncs the directory first.
        self._dir_unsynced = True
        return seg

    def _close(self, seg: Segment) -> None:
        if self.files is not None:
            self.files.close(seg)
        elif seg.fd >= 0:
            fileio.close(seg.fd)
            seg.fd = -1

    def _retire(self, seg: Segment) -> None:
        """``seg`` is written no more: its descriptor goes to the next flush (or, with ``files``,
        is closed: a checkpoint's syncfs makes it durable)."""
        if self.files is not None:
            self.files.close(seg)
        else:
            self.retired_fds.append(fileio.dup(seg.fd))

    def roll_if_needed(self, incoming_bytes: int) -> None:
        """Begin a new segment when ``incoming_bytes`` would not fit the active one."""
        seg = self.active
        if seg.size and seg.size + incoming_bytes > self.segment_bytes:
            self._retire(seg)
            self._new_segment(seg.end)

    def start_segment(self, base: int) -> None:
        """Begin a new segment at ``base`` (the end of the log), as a master did: a slave mirrors it."""
        if base != self.end:
            raise ValueError(f"a new segment must start at the log's end {self.end}, not {base}")
        if self.active.size:
            self._retire(self.active)
            self._new_segment(base)

    def append(self, data: bytes | bytearray | memoryview, roll: bool = True) -> int:
        """Write ``data`` at the end; return its offset. On failure nothing is left half-written.

        ``roll=False`` (a slave) never begins a segment on its own: it follows the master's.
        """
        if roll:
            self.roll_if_needed(len(data))
        seg = self.active
        offset = seg.end
        fd = seg.fd if self.files is None else self.files.fd(seg)
        try:
            fileio.write_all(fd, data)
        except OSError as exc:
            cut_back(fd, seg.head + seg.size, exc)
            raise
        seg.size += len(data)
        if self.files is not None:
            self.files.unsynced = True
        return offset

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes at ``offset`` (fewer if the log ends first); never crosses a segment end."""
        seg = self.segment_for(offset)
        if seg is None:
            return b""
        pos = offset - seg.base
        return fileio.pread(self._fd(seg), min(size, seg.size - pos), seg.head + pos)

    def reader(self) -> Callable[[int, int], bytes]:
        """``read`` for a run of reads made together (one pull's records, each apart from the
        next when many subjects are sent to at once): the segment is looked up again only when a
        read leaves the one before's, and the fault seam's hooks once for the run
        (``fileio.pread_run``). Good until the log next changes (an append, a cut, a removal)."""
        if self.files is not None:  # a descriptor may be closed by the next lookup: each its own
            return self.read
        pread = fileio.pread_run()
        lo = hi = delta = 0
        fd = -1

        def read(offset: int, size: int) -> bytes:
            nonlocal lo, hi, delta, fd
            if not lo <= offset < hi:
                seg = self.segment_for(offset)
                if seg is None:
                    return b""
                lo, hi, delta, fd = seg.base, seg.end, seg.head - seg.base, seg.fd
            return pread(fd, min(size, hi - offset), offset + delta)

        return read

    def locate(self, offset: int) -> tuple[str, int] | None:
        """The file holding the byte before ``offset`` and the position just past that byte in
        it: where the log's first ``offset`` bytes end on disk (for the I/O trace, fileio.py)."""
        seg = self.segment_for(offset - 1)
        return None if seg is None else (seg.path, offset - seg.base + seg.head)

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
            self._close(seg)
            fileio.unlink(seg.path)
        seg = self.active
        if offset < seg.end:
            keep = max(0, offset - seg.base)
            removed += seg.size - keep
            fileio.ftruncate(self._fd(seg), seg.head + keep)
            seg.size = keep
            if self.files is not None:
                self.files.unsynced = True
        return removed

    def delete_before(self, offset: int) -> list[Segment]:
        """Delete whole segments that end at or before ``offset`` (never the active one)."""
        gone: list[Segment] = []
        while len(self.segments) > 1 and self.segments[0].end <= offset:
            seg = self.segments.pop(0)
            if self.files is not None:
                self.files.close(seg)
            else:
                self.retired_fds.append(seg.fd)
            fileio.unlink(seg.path)
            gone.append(seg)
        return gone

    def sync_fds(self) -> list[int]:
        """fds a flush must fsync: the directory if a segment was created since the last flush,
        any segment rolled since, and the active one. With no descriptor free, what would need
        one is fsynced at once instead. Not for a log whose files an OpenFiles keeps."""
        assert self.files is None, "a log in an OpenFiles is made durable by syncfs"
        fds, self.retired_fds = self.retired_fds, []
        if self._dir_unsynced:
            self._dir_unsynced = False
            dir_fd = _dup_or_sync(self._dir_fd, fileio.fsync)
            if dir_fd is not None:
                fds.insert(0, dir_fd)
        active = _dup_or_sync(self.active.fd, fileio.fdatasync)
        if active is not None:
            fds.append(active)
        return fds

    def close(self) -> None:
        for seg in self.segments:
            self._close(seg)
        for fd in self.retired_fds:
            fileio.close(fd)
        if self._dir_fd >= 0:
            fileio.close(self._dir_fd)
            self._dir_fd = -1
        self.segments = []
        self.retired_fds = []


class FlushTicket:
    """fsync work captured on the loop thread; ``run`` may execute on any thread.

    ``syncfs_fd`` (a checkpoint's, or -1) is a descriptor on the data's file system, borrowed
    from its store, whose ``syncfs`` makes every consume log durable. ``on_error`` is told of a
    failed fsync (on the thread that ran it) before ``run`` raises it. ``action_offset`` (or -1)
    is where a second log the same ticket covers ends (the broker's action log, which shares
    its message log's group commit), and ``action_fds`` its descriptors to fsync.

    ``parts`` splits the work in two when there is a second log, to run on two threads at
    once: two fdatasyncs under way together share the file system's journal commit, where one
    after the other would each wait for a commit of its own.
    """

    __slots__ = ("action_fds", "action_offset", "fds", "offset", "on_error", "syncfs_fd")

    def __init__(
        self,
        fds: list[int],
        offset: int,
        on_error: Callable[[OSError], None] | None = None,
        syncfs_fd: int = -1,
        action_offset: int = -1,
        action_fds: list[int] | None = None,
    ) -> None:
        self.fds = fds
        self.offset = offset
        self.action_offset = action_offset
        self.action_fds = action_fds or []
        self.on_error = on_error
        self.syncfs_fd = syncfs_fd

    def parts(self) -> list[Callable[[], None]]:
        """The work of ``run`` as parts that may run at the same time, on threads of their own."""
        if not self.action_fds:
            return [self.run]
        if not self.fds and self.syncfs_fd < 0:
            # nothing of the first log to sync (a flush of acks and pulls only): no second thread
            # to hand to and wait for (bench/flush_cycle.py: ~75 us of CPU a flush on /dev/shm)
            return [self._run_actions]
        return [self._run_main, self._run_actions]

    def run(self) -> None:
        try:
            self._run_main()
        finally:
            self._run_actions()

    def _run_main(self) -> None:
        self._sync(self.fds, self.syncfs_fd)

    def _run_actions(self) -> None:
        self._sync(self.action_fds, -1)

    def _sync(self, fds: list[int], syncfs_fd: int) -> None:
        try:
            for fd in fds:
                if fileio.is_dir(fd):
                    fileio.fsync(fd)  # a new entry: fdatasync need not commit it
                else:
                    fileio.fdatasync(fd)
            if syncfs_fd >= 0:
                syncfs(syncfs_fd)
        except OSError as exc:
            if self.on_error is not None:
                self.on_error(exc)
            raise
        finally:
            for fd in fds:
                fileio.close(fd)
