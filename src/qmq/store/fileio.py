"""The one door of the stores' file I/O (``qmq.store`` and ``qmq.delay``): every open, read,
write, fsync, truncate, rename, unlink and mkdir of their files goes through a function here,
so a test or the fault campaign can make a chosen call fail or wait (a fault plan, whose rules
and file format faultplan.py owns) and record the order of fsyncs and answered sends (the I/O
trace, whose line format iotrace.py owns; trace_check.py checks it).

Each function does what the ``os`` call of its name does. While neither a fault plan nor a
trace is on (always, outside tests and the campaign) it is that call behind one check of the
module flag ``_hooked``; the stores call it once per batch, never once per message. Metadata
lookups (stat, exists) are not part of it.

In-process (tests): ``install(rules)`` or ``with faults(*rules)``, ``start_trace(path)``.
A server process: ``QMQ_FAULT_PLAN=<plan file>`` and ``QMQ_IO_TRACE=<trace file>``
(``QMQ_IO_TRACE_BYTES_MAX``, default 256 MiB), taken up when its store opens
(``from_environment``); a plan or trace that cannot be used stops it from starting. The plan
file is read again whenever it changes (looked at most every 100 ms), so the campaign starts or
stops a fault in a running server by writing a new plan file and renaming it over the old.
"""

from __future__ import annotations

import atexit
import builtins
import contextlib
import ctypes
import errno as errno_codes
import os
import stat
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from qmq.common.errors import QmqError
from qmq.store import faultplan, iotrace
from qmq.store.faultplan import PLAN_ENV, FaultPlan
from qmq.store.iotrace import TRACE_BYTES_ENV, TRACE_BYTES_MAX_DEFAULT, TRACE_ENV, Locates

__all__ = ["PLAN_ENV", "TRACE_BYTES_ENV", "TRACE_ENV", "FaultPlan", "FaultPlanError"]

StrPath = str | Path
Buffer = bytes | bytearray | memoryview

# A fault plan or a trace is on: every call checks this first and does nothing more without.
_hooked = False
# The I/O trace is on: callers that trace answers check this first (``trace_answer``).
tracing = False
_env_read = False


class FaultPlanError(QmqError):
    """``QMQ_FAULT_PLAN`` or ``QMQ_IO_TRACE`` cannot be used; the text says why."""


def _set_hooked() -> None:
    global _hooked, tracing
    tracing = iotrace.on()
    _hooked = tracing or faultplan.installed()


def install(plan: FaultPlan | Sequence[Mapping[str, Any]] | None) -> FaultPlan | None:
    """Make ``plan`` (a FaultPlan or its rules as dicts; None: none) the fault plan of this
    process, replacing any other, the environment's included; returns it."""
    if plan is not None and not isinstance(plan, FaultPlan):
        plan = FaultPlan.parse(list(plan))
    faultplan.install(plan)
    _set_hooked()
    return plan


@contextlib.contextmanager
def faults(*rules: Mapping[str, Any]) -> Iterator[FaultPlan]:
    """A plan of ``rules`` for the ``with`` block (then none); yields it, to read its counts."""
    plan = install(rules)
    assert plan is not None
    try:
        yield plan
    finally:
        install(None)


def start_trace(path: Path, bytes_max: int = TRACE_BYTES_MAX_DEFAULT) -> None:
    """Append this process's I/O trace to ``path`` (iotrace.py) until ``stop_trace``."""
    iotrace.start(path, bytes_max)
    _set_hooked()


def stop_trace() -> None:
    """Write what is buffered and stop tracing."""
    iotrace.stop()
    _set_hooked()


atexit.register(stop_trace)


def trace_answer(segments: Locates, end_offset: int, what: str = "send") -> None:
    """Record a send (``what``: "ack", an ack; "pull", a pull handing out messages) answered
    under ``flush = "sync"`` whose bytes end at ``end_offset`` of the log ``segments``: call just
    before the answer goes out, only while ``tracing``."""
    iotrace.answer(segments, end_offset, what)


def from_environment(environ: Mapping[str, str] | None = None) -> None:
    """Take up ``QMQ_FAULT_PLAN`` and ``QMQ_IO_TRACE`` of the process's environment (once; the
    stores call it when they open), or of ``environ`` (each time: tests). FaultPlanError when the
    plan cannot be read or is wrong, or the trace cannot be opened: a server then does not start."""
    global _env_read
    if environ is None:
        if _env_read:
            return
        _env_read = True
        environ = os.environ
    plan_path = environ.get(PLAN_ENV)
    if plan_path:
        try:
            faultplan.install_file(Path(plan_path))
        except (OSError, ValueError) as exc:
            raise FaultPlanError(f"{PLAN_ENV}={plan_path}: {exc}; fix the fault plan or unset {PLAN_ENV}") from None
    trace_path = environ.get(TRACE_ENV)
    if trace_path:
        raw = environ.get(TRACE_BYTES_ENV, str(TRACE_BYTES_MAX_DEFAULT))
        try:
            iotrace.start(Path(trace_path), int(raw))
        except (OSError, ValueError) as exc:
            raise FaultPlanError(f"{TRACE_ENV}={trace_path} ({TRACE_BYTES_ENV}={raw}): {exc}") from None
    _set_hooked()


def _fd_path(fd: int) -> str:
    try:
        path = os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"<fd {fd}>"
    return path.removesuffix(" (deleted)")


def _path(path: StrPath) -> str:
    return os.path.abspath(path)


def _synced(kind: str, fd: int, sync: Callable[[int], None]) -> None:
    """``sync(fd)`` as the plan says, traced (a failure the plan makes is traced as one too)."""
    path = _fd_path(fd)
    op = "syncfs" if kind == "syncfs" else "fsync"

    def planned(fd: int) -> None:
        faultplan.act(op, path)
        sync(fd)

    iotrace.synced(kind, fd, path, planned)


# -- the calls -------------------------------------------------------------------------


def open(path: StrPath, flags: int, mode: int = 0o644) -> int:
    if not _hooked:
        return os.open(path, flags, mode)
    full = _path(path)
    faultplan.act("open", full)
    new = tracing and flags & os.O_CREAT and not os.path.lexists(full)
    fd = os.open(path, flags, mode)
    if new:
        iotrace.created(full)
    return fd


def close(fd: int) -> None:
    os.close(fd)


def dup(fd: int) -> int:
    return os.dup(fd)


def size(fd: int) -> int:
    """Bytes in the open file ``fd``."""
    return os.fstat(fd).st_size


def is_dir(fd: int) -> bool:
    return stat.S_ISDIR(os.fstat(fd).st_mode)


def pread(fd: int, size: int, offset: int) -> bytes:
    if _hooked:
        faultplan.act("read", _fd_path(fd))
    return os.pread(fd, size, offset)


def pread_run() -> Callable[[int, int, int], bytes]:
    """``pread`` for a run of reads made together (one pull's records, a few hundred): the hooks
    are looked at once for the run, not once a read; with a fault plan or a trace on, each
    read still goes through ``pread``."""
    return pread if _hooked else os.pread


def read_into(path: StrPath, buffer: memoryview) -> int:
    """Fill ``buffer`` (bytes, or e.g. a numpy array's memory) from the start of the file ``path``;
    returns how many bytes it holds, fewer if the file ends first."""
    fd = open(path, os.O_RDONLY)
    try:
        if _hooked:
            faultplan.act("read", _path(path))
        view = buffer.cast("B")
        got = 0
        while got < len(view):  # bounded: each read moves on, or the file has ended
            n = os.preadv(fd, [view[got:]], got)
            if n <= 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


def read_file(path: StrPath) -> bytes:
    """The whole file ``path`` (FileNotFoundError if there is none)."""
    if _hooked:
        full = _path(path)
        faultplan.act("open", full)
        faultplan.act("read", full)
    with builtins.open(path, "rb") as f:
        return f.read()


def read_text(path: StrPath) -> str:
    return read_file(path).decode("utf-8")


def write_all(fd: int, data: Buffer) -> None:
    """Write all of ``data``: ``write(2)`` may write less than asked (near a full disk), so write
    the rest; a write that makes no progress is ENOSPC. On failure part may be written: the
    caller cuts the file back."""
    if _hooked:
        faultplan.act("write", _fd_path(fd))
    view = memoryview(data)
    while view:  # bounded: every write moves on or raises
        n = os.write(fd, view)
        if n <= 0:
            raise OSError(errno_codes.ENOSPC, f"write made no progress with {len(view)} bytes left")
        view = view[n:]


def pwrite_all(fd: int, data: Buffer, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (a file opened without O_APPEND): an overwrite in place."""
    if _hooked:
        faultplan.act("write", _fd_path(fd))
    view = memoryview(data)
    while view:  # bounded: every write moves on or raises
        n = os.pwrite(fd, view, offset)
        if n <= 0:
            raise OSError(errno_codes.ENOSPC, f"write made no progress with {len(view)} bytes left")
        view = view[n:]
        offset += n


def copy_file(src: StrPath, dst: StrPath) -> None:
    """Write a copy of ``src`` at ``dst`` (replacing it; not fsynced)."""
    data = read_file(src)
    fd = open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def ftruncate(fd: int, size: int) -> None:
    if _hooked:
        faultplan.act("truncate", _fd_path(fd))
    os.ftruncate(fd, size)


def truncate(path: StrPath, size: int) -> None:
    if _hooked:
        faultplan.act("truncate", _path(path))
    os.truncate(path, size)


def fsync(fd: int) -> None:
    if not _hooked:
        os.fsync(fd)
        return
    _synced("fsync", fd, os.fsync)


def fdatasync(fd: int) -> None:
    if not _hooked:
        os.fdatasync(fd)
        return
    _synced("fdatasync", fd, os.fdatasync)


def fsync_dir(path: StrPath) -> None:
    """fsync a directory, so the entries made in it (new files, renames) survive a power loss."""
    fd = open(path, os.O_RDONLY)
    try:
        fsync(fd)
    finally:
        os.close(fd)


def fsync_path(path: StrPath) -> bool:
    """fsync a file (or directory) by its path; False if it is gone."""
    try:
        fd = open(path, os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fsync(fd)
    finally:
        os.close(fd)
    return True


def _libc_syncfs() -> Callable[[int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).syncfs
    except (OSError, AttributeError):  # not Linux
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


_syncfs = _libc_syncfs()


def _syncfs_now(fd: int) -> None:
    if _syncfs is None:
        os.sync()
    elif _syncfs(fd) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"syncfs: {os.strerror(err)}")


def syncfs(fd: int) -> None:
    """Make every file of the file system holding ``fd`` durable, closed ones included.

    Linux reports (since 5.8) a writeback error of any file of that file system since the
    last syncfs through the same open descriptor; elsewhere this is ``sync()``, which reports none.
    """
    if not _hooked:
        _syncfs_now(fd)
        return
    _synced("syncfs", fd, _syncfs_now)


def sync() -> None:
    """Every file system's writes, durable (``sync()``: no error is ever reported)."""
    if _hooked:
        faultplan.act("syncfs", "/")
    os.sync()


def replace(src: StrPath, dst: StrPath) -> None:
    if _hooked:
        full = _path(dst)
        faultplan.act("rename", _path(src), full)
        os.replace(src, dst)
        iotrace.created(full)
        return
    os.replace(src, dst)


def replace_file(path: StrPath, data: bytes) -> None:
    """Make ``path`` hold ``data`` atomically and durably: a temp file written whole and fsynced,
    renamed over ``path``, and the rename fsynced into the directory. A crash leaves the old
    contents or the new, never a torn or empty file."""
    tmp = f"{os.fspath(path)}.tmp"
    fd = open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        write_all(fd, data)
        fsync(fd)
    finally:
        close(fd)
    replace(tmp, path)
    fsync_dir(os.path.dirname(os.path.abspath(os.fspath(path))))


def unlink(path: StrPath, missing_ok: bool = False) -> None:
    if _hooked:
        faultplan.act("unlink", _path(path))
    try:
        os.unlink(path)
    except FileNotFoundError:
        if not missing_ok:
            raise


def rmdir(path: StrPath) -> None:
    if _hooked:
        faultplan.act("unlink", _path(path))
    os.rmdir(path)


def mkdir(path: StrPath) -> None:
    """Create one directory (FileExistsError if it is there; FileNotFoundError without its parent)."""
    if _hooked:
        full = _path(path)
        faultplan.act("mkdir", full)
        os.mkdir(path)
        iotrace.created(full)
        return
    os.mkdir(path)


def make_dirs(path: StrPath) -> None:
    """Create ``path`` and any missing parents, each made durable in its parent at once (a
    directory is created once, when a store first starts in it)."""
    path = Path(os.path.abspath(path))
    missing: list[Path] = []
    while not path.is_dir():  # bounded by the path's depth
        missing.append(path)
        if path.parent == path:
            break
        path = path.parent
    for new in reversed(missing):
        try:
            mkdir(new)
        except FileExistsError:
            continue  # made meanwhile by another process
        fsync_dir(new.parent)


def listdir(path: StrPath) -> list[str]:
    if _hooked:
        faultplan.act("listdir", _path(path))
    return os.listdir(path)
