"""Free space of a server's data directory, checked at most once a second: below the minimum,
sends are refused with DISK_FULL (retriable) instead of failing half-way through a write."""

from __future__ import annotations

import os
import time
from pathlib import Path

_CHECK_INTERVAL_S = 1.0


class FreeSpace:
    def __init__(self, directory: Path, min_bytes: int) -> None:
        self.directory = directory
        self.min_bytes = min_bytes
        self._checked = 0.0
        self._low = False

    def low(self) -> str | None:
        """None with enough free space, else the text of the refusal."""
        now = time.monotonic()
        if now - self._checked >= _CHECK_INTERVAL_S:
            self._checked = now
            st = os.statvfs(self.directory)
            self._low = st.f_bavail * st.f_frsize < self.min_bytes
        if not self._low:
            return None
        return (
            f"free space on the disk of {str(self.directory)!r} is below disk_free_bytes_min "
            f"{self.min_bytes}; free space or move the data directory"
        )
