"""The I/O trace of the file-I/O seam (fileio.py): the order of fsyncs and answered sends, for
the power-loss check of the fault campaign (trace_check.py reads it).

With ``QMQ_IO_TRACE=<file>`` (or ``start_trace``) a process appends one line per event to
the file, fields separated by tabs, the path last; times are ``CLOCK_MONOTONIC`` ns, shared
by every process of the machine, so several servers may append to one file::

    # qmq io trace 1 pid=<pid>
    sync    <pid> <kind> <start_ns> <end_ns> <size> <path>    a completed fsync
    failed  <pid> <kind> <start_ns> <end_ns> <errno> <path>   a failed one
    create  <pid> <ns> <path>                                  a new file or directory entry
    answer  <pid> <ns> <pos> <offset> <path>                   a send answered under flush = "sync"
    ack     <pid> <ns> <pos> <offset> <path>                   an ack answered under flush = "sync"
    pull    <pid> <ns> <pos> <offset> <path>                   a pull handing out messages, likewise
    # stopped: <bytes> bytes, QMQ_IO_TRACE_BYTES_MAX; nothing later is traced

``kind`` is ``fsync``, ``fdatasync``, ``dirsync`` (an fsync of a directory) or ``syncfs``;
``size`` is the file's size when the fsync began (what it covers; ``-`` for a directory or a
file system). An ``answer`` line is written just before the answer of a send (the broker's
message log, the delay server's write-ahead log) goes out: the send's bytes, and all before
it, end at byte ``pos`` of the segment file ``path``; ``offset`` is that end as an offset of
the log. An ``ack`` line is the same for an ack (or a pull carrying acks) answered as done,
a ``pull`` line for a pull answered with messages: their records end there in the broker's
action log. ``trace_check.py`` reads a trace and finds
every answer that came before the fsync covering it. Lines are buffered and written whole, at
the latest with the next fsync line, so a process killed with ``kill -9`` leaves a trace that
is a prefix of what happened. The trace stops at ``QMQ_IO_TRACE_BYTES_MAX`` bytes (default
256 MiB) and says so in its last line.
"""

from __future__ import annotations

import errno as errno_codes
import os
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

TRACE_ENV = "QMQ_IO_TRACE"
TRACE_BYTES_ENV = "QMQ_IO_TRACE_BYTES_MAX"
TRACE_BYTES_MAX_DEFAULT = 256 * 1024 * 1024
TRACE_VERSION = 1
_TRACE_BUFFER_BYTES = 64 * 1024


class _Trace:
    """The trace file: whole lines, buffered, written with one ``write`` each time."""

    def __init__(self, path: Path, bytes_max: int) -> None:
        if bytes_max < 1024:
            raise ValueError(f"a trace of at most {bytes_max} bytes; at least 1024")
        self.path = path
        self.bytes_max = bytes_max
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.pid = os.getpid()
        self.lines: list[bytes] = []
        self.buffered = 0
        self.written = 0
        self.stopped = False
        self.lock = threading.Lock()
        self.add(f"# qmq io trace {TRACE_VERSION} pid={self.pid}\n", flush=True)

    def add(self, line: str, flush: bool = False) -> None:
        data = line.encode("utf-8", "surrogateescape")
        with self.lock:
            if self.stopped:
                return
            if self.written + self.buffered + len(data) > self.bytes_max - 200:
                self.stopped = True
                data = f"# stopped: {self.bytes_max} bytes, {TRACE_BYTES_ENV}; nothing later is traced\n".encode()
                flush = True
            self.lines.append(data)
            self.buffered += len(data)
            if flush or self.buffered >= _TRACE_BUFFER_BYTES:
                self._flush()

    def _flush(self) -> None:
        if self.lines:
            data = b"".join(self.lines)
            self.lines, self.buffered = [], 0
            self.written += len(data)
            view = memoryview(data)
            while view:  # whole lines in one write each time; the rest if the write fell short
                view = view[os.write(self.fd, view) :]

    def close(self) -> None:
        with self.lock:
            self._flush()
            self.stopped = True
            os.close(self.fd)


_trace: _Trace | None = None


def start(path: Path, bytes_max: int = TRACE_BYTES_MAX_DEFAULT) -> None:
    """Append this process's trace to ``path`` until ``stop``."""
    global _trace
    stop()
    _trace = _Trace(path, bytes_max)


def stop() -> None:
    """Write what is buffered and stop tracing."""
    global _trace
    trace, _trace = _trace, None
    if trace is not None:
        trace.close()


def on() -> bool:
    return _trace is not None


class Locates(Protocol):
    def locate(self, offset: int) -> tuple[str, int] | None:
        """The file holding the byte before ``offset`` of a log, and where that byte ends in it."""
        ...


def answer(segments: Locates, end_offset: int, what: str = "send") -> None:
    """A send (``what``: "ack", an ack; "pull", a pull handing out messages) whose bytes end at
    ``end_offset`` of the log ``segments`` is being answered."""
    trace = _trace
    if trace is None or end_offset <= 0:
        return
    where = segments.locate(end_offset)
    if where is None:
        return
    path, pos = where
    event = what if what in ("ack", "pull") else "answer"
    trace.add(f"{event}\t{trace.pid}\t{time.monotonic_ns()}\t{pos}\t{end_offset}\t{path}\n")


def synced(kind: str, fd: int, path: str, sync: Callable[[int], None]) -> None:
    """``sync(fd)`` (which may raise before syncing: a fault), its completion or failure traced."""
    trace = _trace
    if trace is None:
        sync(fd)
        return
    st = os.fstat(fd)
    if stat.S_ISDIR(st.st_mode) and kind != "syncfs":
        kind, size = "dirsync", "-"
    else:
        size = "-" if kind == "syncfs" else str(st.st_size)
    start_ns = time.monotonic_ns()
    try:
        sync(fd)
    except OSError as exc:
        name = errno_codes.errorcode.get(exc.errno or 0, str(exc.errno))
        trace.add(f"failed\t{trace.pid}\t{kind}\t{start_ns}\t{time.monotonic_ns()}\t{name}\t{path}\n", flush=True)
        raise
    trace.add(f"sync\t{trace.pid}\t{kind}\t{start_ns}\t{time.monotonic_ns()}\t{size}\t{path}\n", flush=True)


def created(path: str) -> None:
    """A new directory entry at ``path``."""
    trace = _trace
    if trace is not None:
        trace.add(f"create\t{trace.pid}\t{time.monotonic_ns()}\t{path}\n")
