"""The history a worker writes as it goes: one tab-separated line per event, appended with one
``write`` each time, so a worker killed with ``kill -9`` leaves a prefix of what it did.

    S  <id> <kind> <due_ms>             a send is about to be made (kind: rt, delay, tx)
    A  <id> <ms>                         the send was acknowledged (a tx send: its commit returned)
    D  <group> <id> <times> <ms>         a message was delivered to a consumer of <group>
    K  <group> <id> <times> <ms>         the ack of that delivery was answered as done

Times are wall-clock milliseconds of this machine, as the servers' delay times are.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path


def now_ms() -> int:
    return time.time_ns() // 1_000_000


class HistoryFile:
    """Appends whole lines to one history file."""

    def __init__(self, path: Path) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write(self, lines: Iterable[str]) -> None:
        data = "".join(lines).encode()
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        os.close(self.fd)
