"""The tests' fsync spy, loaded at start-up by every Python process that has this directory on
its PYTHONPATH (``sitecustomize``): when ``$QMQ_TEST_FSYNC_LOG`` names a file, each ``os.fsync``
first appends ``<pid> <path of the file>`` to it, then runs. So a test counts fsyncs as they
start, not once they finish, and knows which file each was for.
"""

from __future__ import annotations

import os
from typing import Any

_LOG = os.environ.get("QMQ_TEST_FSYNC_LOG")

if _LOG:
    _log_fd = os.open(_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    _fsync = os.fsync

    def _spied_fsync(fd: Any) -> None:
        number = fd if isinstance(fd, int) else fd.fileno()
        try:
            path = os.readlink(f"/proc/self/fd/{number}")
        except OSError:
            path = "?"
        os.write(_log_fd, f"{os.getpid()} {path}\n".encode())  # one O_APPEND write: lines never mix
        _fsync(fd)

    os.fsync = _spied_fsync
