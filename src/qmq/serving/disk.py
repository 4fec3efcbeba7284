"""Free space of a server's data directory, checked at most once a second: below the minimum,
sends are refused with DISK_FULL (retriable) instead of failing half-way through a write.
Past ``pending_flush_bytes_max`` written and not yet fsynced, sends are refused as BUSY."""

from __future__ import annotations

import os
import time
from pathlib import Path

from qmq.protocol.codes import Status

_CHECK_INTERVAL_S = 1.0


class FreeSpace:
    """Whether the data directory's disk can take writes: free space under ``min_bytes``, or a
    write that met a full disk (ENOSPC) within the last second. Either clears by itself once
    space is freed: the next check, at most a second later, finds it."""

    def __init__(self, directory: Path, min_bytes: int) -> None:
        self.directory = directory
        self.min_bytes = min_bytes
        self._checked = 0.0
        self._low = False
        self._full_text: str | None = None  # what the last write that met a full disk said

    def low(self) -> str | None:
        """None with enough free space, else the text of the refusal."""
        now = time.monotonic()
        if now - self._checked >= _CHECK_INTERVAL_S:
            self._checked = now
            self._full_text = None
            st = os.statvfs(self.directory)
            self._low = st.f_bavail * st.f_frsize < self.min_bytes
        if self._full_text is not None:
            return self._full_text
        if not self._low:
            return None
        return (
            f"free space on the disk of {str(self.directory)!r} is below disk_free_bytes_min "
            f"{self.min_bytes}; free space or move the data directory"
        )

    def met_full(self, text: str) -> None:
        """A write found the disk full: refuse sends with ``text`` until the next check."""
        self._full_text = text
        self._checked = time.monotonic()


def disk_refusal(free_space: FreeSpace, unflushed_bytes: int, unflushed_bytes_max: int) -> tuple[Status, str] | None:
    """Why the disk cannot take a send now, as (status, text); None when it can."""
    low = free_space.low()
    if low is not None:
        return Status.DISK_FULL, low
    if unflushed_bytes > unflushed_bytes_max:
        return Status.BUSY, "too many bytes are waiting for fsync; retry shortly"
    return None
