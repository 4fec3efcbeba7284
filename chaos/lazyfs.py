"""A FUSE file system that forgets what was not fsynced, for the power-loss scenario (in the
manner of Jepsen's LazyFS, written here in Python over libfuse 3 through mfusepy).

    python -m chaos.lazyfs BACKING_DIR MOUNT_POINT

Every call passes through to BACKING_DIR at once (reads see every write), and the layer keeps
what it would take to undo each change not yet made durable:

- a write or truncate of a file: the bytes it overwrote and the file's size before, until an
  fsync or fdatasync of that file;
- a new file or directory: until an fsync of the directory it is in.

Unmounting it (``fusermount3 -u MOUNT_POINT``, once the servers using it were killed) is the
power cut: before it exits it undoes, newest first, everything not made durable, so
BACKING_DIR holds what a disk would after losing power. Mount it again to start anew.

Not modelled: ``syncfs`` (libfuse's high-level API does not pass it on), so writes to files
under a ``consume/`` directory (the broker's consume logs, made durable by a checkpoint's
syncfs) count as durable at once; renames and unlinks are durable at once.
"""

from __future__ import annotations

import errno
import os
import sys
import threading
from dataclasses import dataclass, field
from typing import Any

import mfusepy as fuse

_UNDO_BYTES_MAX = 512 * 1024 * 1024  # past this, the layer stops (it cannot promise to undo)


@dataclass
class _FileUndo:
    size_before: int  # the size when the first change since the last fsync was made
    writes: list[tuple[int, bytes]] = field(default_factory=list)  # (offset, old bytes), oldest first


class LazyFS(fuse.Operations):  # type: ignore[misc]  # mfusepy is untyped
    use_ns = True

    def __init__(self, root: str) -> None:
        self.root = os.path.realpath(root)
        self._mutex = threading.Lock()
        self.files: dict[str, _FileUndo] = {}  # relative path -> what undoes its unsynced changes
        self.created: dict[str, list[str]] = {}  # directory -> entries made since its last fsync
        self.undo_bytes = 0

    def _full(self, path: str) -> str:
        return os.path.join(self.root, path.lstrip("/"))

    @staticmethod
    def _lazy(path: str) -> bool:
        return "/consume/" not in path

    # -- what is remembered ---------------------------------------------------------------

    def _remember(self, path: str, fd: int, offset: int, length: int) -> None:
        """Keep what a write or truncate at [offset, offset + length) is about to change."""
        if not self._lazy(path):
            return
        size = os.fstat(fd).st_size
        with self._mutex:
            undo = self.files.get(path)
            if undo is None:
                undo = self.files[path] = _FileUndo(size)
            if offset < size:
                old = os.pread(fd, min(length, size - offset), offset)
                undo.writes.append((offset, old))
                self.undo_bytes += len(old)
                if self.undo_bytes > _UNDO_BYTES_MAX:
                    raise fuse.FuseOSError(errno.ENOSPC)

    def _made(self, path: str) -> None:
        if not self._lazy(path + "/"):
            return
        parent = os.path.dirname(path) or "/"
        with self._mutex:
            self.created.setdefault(parent, []).append(path)

    def crash(self) -> tuple[int, int]:
        """Undo everything not durable; (files reverted, entries removed)."""
        with self._mutex:
            reverted = 0
            for path, undo in self.files.items():
                full = self._full(path)
                if not os.path.exists(full):
                    continue
                with open(full, "r+b") as f:
                    for offset, old in reversed(undo.writes):
                        f.seek(offset)
                        f.write(old)
                    f.truncate(undo.size_before)
                reverted += 1
            removed = 0
            for entries in self.created.values():
                for path in reversed(entries):
                    full = self._full(path)
                    if os.path.isdir(full) and not os.path.islink(full):
                        _remove_tree(full)
                    elif os.path.lexists(full):
                        os.unlink(full)
                    removed += 1
            self.files.clear()
            self.created.clear()
            os.sync()
            return reverted, removed

    # -- the file system ------------------------------------------------------------------

    def getattr(self, path: str, fh: int | None = None) -> dict[str, Any]:
        st = os.fstat(fh) if fh is not None else os.lstat(self._full(path))
        keys = ("st_mode", "st_nlink", "st_uid", "st_gid", "st_size", "st_ino", "st_dev")
        attrs: dict[str, Any] = {k: getattr(st, k) for k in keys}
        attrs.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
        return attrs

    def readdir(self, path: str, fh: int) -> list[str]:
        return [".", "..", *os.listdir(self._full(path))]

    def statfs(self, path: str) -> dict[str, int]:
        st = os.statvfs(self._full(path))
        keys = ("f_bavail", "f_bfree", "f_blocks", "f_bsize", "f_favail", "f_ffree", "f_files", "f_flag",
                "f_frsize", "f_namemax")
        return {k: getattr(st, k) for k in keys}

    def access(self, path: str, amode: int) -> int:
        if not os.access(self._full(path), amode):
            raise fuse.FuseOSError(errno.EACCES)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        os.chmod(self._full(path), mode)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        if times is None:
            os.utime(self._full(path))
        else:
            os.utime(self._full(path), ns=times)
        return 0

    def mkdir(self, path: str, mode: int) -> int:
        os.mkdir(self._full(path), mode)
        self._made(path)
        return 0

    def rmdir(self, path: str) -> int:
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        os.unlink(self._full(path))
        with self._mutex:
            self.files.pop(path, None)
        return 0

    def rename(self, old: str, new: str) -> int:
        os.replace(self._full(old), self._full(new))
        with self._mutex:
            undo = self.files.pop(old, None)
            self.files.pop(new, None)
            if undo is not None:
                self.files[new] = undo
        return 0

    def open(self, path: str, flags: int) -> int:
        return os.open(self._full(path), _read_write(flags))

    def create(self, path: str, mode: int, fi: Any = None) -> int:
        fd = os.open(self._full(path), os.O_RDWR | os.O_CREAT | os.O_TRUNC, mode)
        self._made(path)
        return fd

    def read(self, path: str, size: int, offset: int, fh: int) -> bytes:
        return os.pread(fh, size, offset)

    def write(self, path: str, data: bytes, offset: int, fh: int) -> int:
        self._remember(path, fh, offset, len(data))
        return os.pwrite(fh, data, offset)

    def truncate(self, path: str, length: int, fh: int | None = None) -> int:
        fd = fh if fh is not None else os.open(self._full(path), os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            if length < size:
                self._remember(path, fd, length, size - length)
            else:
                self._remember(path, fd, size, 0)
            os.ftruncate(fd, length)
        finally:
            if fh is None:
                os.close(fd)
        return 0

    def flush(self, path: str, fh: int) -> int:
        return 0

    def release(self, path: str, fh: int) -> int:
        os.close(fh)
        return 0

    def fsync(self, path: str, datasync: int, fh: int) -> int:
        os.fsync(fh)
        with self._mutex:
            undo = self.files.pop(path, None)
            if undo is not None:
                self.undo_bytes -= sum(len(old) for _o, old in undo.writes)
        return 0

    def fsyncdir(self, path: str, datasync: int, fh: int) -> int:
        with self._mutex:
            self.created.pop(path if path == "/" else path.rstrip("/"), None)
        return 0


def _read_write(flags: int) -> int:
    """Open for writing also for reading (the layer reads what a write overwrites), and never
    O_APPEND (the kernel gives each write its offset)."""
    flags &= ~os.O_APPEND
    if flags & os.O_ACCMODE == os.O_WRONLY:
        flags = (flags & ~os.O_ACCMODE) | os.O_RDWR
    return flags


def _remove_tree(path: str) -> None:
    for dirpath, dirnames, filenames in os.walk(path, topdown=False):
        for name in filenames:
            os.unlink(os.path.join(dirpath, name))
        for name in dirnames:
            os.rmdir(os.path.join(dirpath, name))
    os.rmdir(path)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m chaos.lazyfs BACKING_DIR MOUNT_POINT", file=sys.stderr)
        return 2
    ops = LazyFS(argv[0])
    print(f"qmq ready lazyfs backing={ops.root} mount={argv[1]}", flush=True)
    fuse.FUSE(ops, argv[1], foreground=True, nothreads=False, allow_other=False)
    reverted, removed = ops.crash()
    print(f"lazyfs unmounted: {reverted} file(s) cut back to their last fsync, {removed} new entries removed",
          flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
