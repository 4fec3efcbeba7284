"""What every server's store shares about its data directory: the errors a store raises, the
lock that keeps a second server out of it, and turning an ``OSError`` into the right error.

The broker's store and the delay server's store both use these, so a server's request
handling maps one ``StoreError``/``DiskFullError`` pair to its answers (``qmq.serving``).
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

from qmq.common.errors import QmqError
from qmq.store import fileio

LOCK_FILE = "LOCK"


class StoreError(QmqError):
    """The store cannot carry on (data directory in use, disk error)."""


class DiskFullError(StoreError):
    """No room on the data directory's disk; clears by itself once space is freed."""

    retriable = True


class StoreFailedError(StoreError):
    """A request refused before it wrote anything, because the store stopped taking writes (a
    failed fsync): asking again may succeed, of the store restarted or of the slave promoted in
    its place, which holds every pull and ack the master answered (so a consumer keeps its acks
    for them rather than drop them, and they take there)."""

    retriable = True


class OutOfFilesError(StoreError):
    """The process (or the system) has no file descriptor to spare; clears by itself once some
    are closed (connections end, the store closes files it caches)."""

    retriable = True


class DataDirLock:
    """An exclusive ``flock`` on ``<data_dir>/LOCK`` holding the owner's pid, for the life of a store."""

    def __init__(self, directory: Path, owner: str) -> None:
        """Take the lock; ``StoreError`` naming ``owner`` (e.g. "broker") when another process holds it."""
        self.fd = fileio.open(directory / LOCK_FILE, os.O_RDWR | os.O_CREAT)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            fileio.close(self.fd)
            raise StoreError(
                f"data directory {str(directory)!r} is in use by another {owner}; stop it or choose another --data-dir"
            ) from None
        fileio.ftruncate(self.fd, 0)
        fileio.write_all(self.fd, f"{os.getpid()}\n".encode())

    def release(self) -> None:
        if self.fd >= 0:
            fileio.close(self.fd)
            self.fd = -1


def store_error(exc: OSError, directory: Path) -> StoreError:
    """``DiskFullError`` for a full disk or quota, ``OutOfFilesError`` when no file descriptor is
    free, else ``StoreError``, each naming ``directory``."""
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return DiskFullError(f"the disk of {str(directory)!r} is full; free space or move the data directory")
    if exc.errno in (errno.EMFILE, errno.ENFILE):
        return OutOfFilesError(
            f"no file descriptor is free to write to {str(directory)!r} ({exc.strerror}); retry shortly, "
            "or raise the open-file limit (ulimit -n) or lower open_files_max"
        )
    return StoreError(f"writing to {str(directory)!r} failed: {exc}")


def clears_by_itself(err: StoreError) -> bool:
    """Whether ``err`` (from ``store_error``) passes without a restart: a full disk, no free descriptor."""
    return isinstance(err, DiskFullError | OutOfFilesError)
