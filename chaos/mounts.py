"""Small real filesystems for the full-disk scenario: a size-limited tmpfs mounted on a data
directory (the campaign runs as root), filled with a ballast file and freed again."""

from __future__ import annotations

import contextlib
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

BALLAST = "chaos-ballast"


@contextlib.contextmanager
def tmpfs(path: Path, size_bytes: int) -> Iterator[Path]:
    """``path`` (made if missing) is a tmpfs of ``size_bytes`` inside the block; unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", str(path)], check=True)
    try:
        yield path
    finally:
        # lazily: a process killed a moment ago may still hold a file open there
        subprocess.run(["umount", "-l", str(path)], check=False)


def free_bytes(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def fill(path: Path, leave_bytes: int) -> None:
    """Take all but ``leave_bytes`` of the free space of ``path``'s filesystem (a ballast file)."""
    ballast = path / BALLAST
    grow = free_bytes(path) - leave_bytes
    if grow <= 0:
        return
    fd = os.open(ballast, os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        size = os.fstat(fd).st_size
        os.posix_fallocate(fd, size, grow)
    finally:
        os.close(fd)


def free(path: Path) -> None:
    (path / BALLAST).unlink(missing_ok=True)
