"""A bound on the files a store keeps open for logs that are many (consume logs, one or more
segment files per subject): opened when used, closed least recently used first.

A closed file is not fsynced: the checkpoint makes such files durable with one ``syncfs`` of
the data directory's file system (``segments.syncfs``), which also reports a writeback error
of any of them, closed or not. One fdatasync per file would take about 2.3 ms each here, 90 s
for 40,000 subjects; a syncfs after writing 20,000 new files took about 1 s.

Running out of descriptors anyway (connections use them too) sheds a quarter of the open files
and tries once more, so it passes once descriptors are free again.
"""

from __future__ import annotations

import errno
import logging
import os
import resource
from collections import OrderedDict
from typing import TYPE_CHECKING

from qmq.store import fileio

if TYPE_CHECKING:
    from collections.abc import Callable

    from qmq.store.segments import Segment

log = logging.getLogger(__name__)

_OUT_OF_FILES = (errno.EMFILE, errno.ENFILE)
_FILES_MIN = 16


def files_max_within_limit(files_max: int) -> int:
    """``files_max``, or half the process's open-file limit if that is lower (the other half
    is left to connections and every other file)."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or files_max <= soft // 2:
        return files_max
    bounded = max(_FILES_MIN, soft // 2)
    log.info("open_files_max %d is more than half the open-file limit %d: using %d", files_max, soft, bounded)
    return bounded


class OpenFiles:
    def __init__(self, files_max: int) -> None:
        self.files_max = files_max
        self._open: OrderedDict[Segment, None] = OrderedDict()  # least recently used first
        self.unsynced = False  # a file was written since the last ``syncfs`` took it into account
        self.closed = 0  # files closed to stay within the bound

    def __len__(self) -> int:
        return len(self._open)

    def fd(self, seg: Segment) -> int:
        """The descriptor of ``seg``'s file, opened now if it was closed."""
        fd = seg.fd
        if fd >= 0:
            self._open.move_to_end(seg)
            return fd
        return self.opened(seg, lambda: fileio.open(seg.path, os.O_RDWR | os.O_APPEND))

    def opened(self, seg: Segment, opener: Callable[[], int]) -> int:
        """Open ``seg``'s file with ``opener`` (closing others first to stay within the bound)
        and keep it open until it is the least recently used one over the bound."""
        while len(self._open) >= self.files_max:
            self._close_oldest()
        try:
            fd = opener()
        except OSError as exc:
            if exc.errno not in _OUT_OF_FILES or not self._open:
                raise
            for _ in range(len(self._open) // 4 + 1):  # others hold descriptors too: make room once
                self._close_oldest()
            fd = opener()
        seg.fd = fd
        self._open[seg] = None
        return fd

    def close(self, seg: Segment) -> None:
        if seg.fd >= 0:
            self._open.pop(seg, None)
            fd, seg.fd = seg.fd, -1
            fileio.close(fd)

    def _close_oldest(self) -> None:
        seg, _ = self._open.popitem(last=False)
        fd, seg.fd = seg.fd, -1
        self.closed += 1
        fileio.close(fd)
