"""The schedule log of one time bucket: the delay messages due in ``[start, start + length)``,
in three append-only files under ``schedule/<start_ms as 16 digits>/``.

This module is the one home of the layouts of ``messages`` and ``index`` (format version 1;
the version is not written in the files, which hold entries only: a new layout needs a new
version here and a migration). Two more files begin with the store's versioned file header and
have modules of their own: ``dispatch`` (dispatch_log.py) and ``ids``, a hash of each entry's
message id for cancels (ids.py). What a checkpoint keeps of a bucket is in checkpoint.py.

``messages``: records exactly as in the write-ahead log (``qmq.protocol.record``: a 28-byte
header with CRC32C, then the message as the producer encoded it, ``deliver_at_ms`` included).

``index``: one 20-byte entry per message, in the order the messages were appended; entry ``n``
sits at ``n × 20`` (little-endian)::

    0                   8                   16        20
    +-------------------+-------------------+---------+
    | due_ms            | offset            | size    |
    +-------------------+-------------------+---------+

    due_ms   i64  when the message is due (epoch ms)
    offset   u64  where its record starts in ``messages``
    size     u32  bytes of the record (header and message)

``dispatch``: the entry number in ``index`` of each message done with: acknowledged by a
broker, or cancelled (a cancelled message is never loaded again, so its bytes never reach
memory), in that order, each with a CRC32C of its own (dispatch_log.py: a damaged entry is
dropped, so its message is handed over again rather than lost).

Replay (schedule.py) appends to ``messages`` and ``index`` through an in-memory buffer (``add``,
``flush``; ``messages`` is always written before ``index``, so an entry never points past
the records). A flush that fails cuts both files back to what they held, so the buffer, kept,
is written whole by the next one; what is still buffered is read from memory. Both are
fsynced before a checkpoint names their sizes; after a crash they are cut back to those sizes
and rebuilt from the write-ahead log in the same order, so entry numbers, and the dispatch
log that names them, stay valid. The dispatch log is written after every broker
acknowledgement and fsynced with checkpoints: an entry lost in a machine crash means one
message handed over again, which the broker's duplicate window drops.
"""

from __future__ import annotations

import contextlib
import logging
import os
import struct
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from qmq.delay import dispatch_log
from qmq.delay.dispatch_log import ENTRY_BYTES, ENTRY_DTYPE, DispatchRead
from qmq.delay.ids import (
    ID_ENTRY,
    ID_ENTRY_BYTES,
    IDS_DTYPE,
    IDS_KIND,
    id_hash,
    read_ids,
    record_id_hashes,
    record_message_id,
)
from qmq.protocol.message import HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER_BYTES, RECORD_MAGIC, read_record_header, record_crc_ok
from qmq.store import fileio
from qmq.store.file_header import HEAD_BYTES, header
from qmq.store.segments import cut_back

FORMAT_VERSION = 1
INDEX_ENTRY = struct.Struct("<qQI")
INDEX_ENTRY_BYTES = INDEX_ENTRY.size  # 20
INDEX_DTYPE = np.dtype([("due", "<i8"), ("offset", "<u8"), ("size", "<u4")])
DISPATCH_ENTRY_BYTES = ENTRY_BYTES  # an entry number in memory and on the wire (the file adds its CRC)
DISPATCH_DTYPE = ENTRY_DTYPE
DISPATCH_TYPECODE = "I"  # array.array's 4-byte unsigned int: the entry's bytes on little-endian Linux
ENTRIES_MAX = 0xFFFF_FFFF  # entry numbers are u32 in the dispatch log
_RECORD_BYTES_MIN = RECORD_HEADER_BYTES + HEADER_BYTES
_RECORD_MAGIC_BYTES = RECORD_MAGIC.to_bytes(4, "little")
# deliver_at_ms in an encoded message: an i64 at byte 16 (qmq.protocol.message)
_DELIVER_AT = struct.Struct("<q")
_DELIVER_AT_POS = 16

MESSAGES = "messages"
INDEX = "index"
DISPATCH = "dispatch"
IDS = "ids"
_NAME_DIGITS = 16

log = logging.getLogger(__name__)

assert INDEX_DTYPE.itemsize == INDEX_ENTRY_BYTES


def bucket_dir_name(start_ms: int) -> str:
    return f"{start_ms:0{_NAME_DIGITS}d}"


def bucket_start_of(name: str) -> int | None:
    """The start of the bucket a directory name stands for, or None if it names none."""
    return int(name) if len(name) == _NAME_DIGITS and name.isdigit() else None


class Bucket:
    """One time bucket's schedule log and the summary of it kept in memory (a few ints).

    ``count`` and ``nbytes`` include what is still buffered; ``dispatched`` counts the
    dispatch log's entries; ``dispatch_damaged`` the entries its dispatch logs held that failed
    their check (each file counted, and logged, once). Files are opened when used and closed
    by ``close`` (a bucket that is not loaded keeps none open).
    """

    __slots__ = (
        "_dispatch_damage_seen",
        "_dispatch_fd",
        "_ids_wfd",
        "_index_wfd",
        "_messages_fd",
        "_messages_wfd",
        "count",
        "directory",
        "dirty",
        "dispatch_damaged",
        "dispatched",
        "flushed_bytes",
        "flushed_count",
        "loaded",
        "min_due_ms",
        "nbytes",
        "pending_ids",
        "pending_index",
        "pending_messages",
        "start_ms",
        "unsynced_bytes",
        "wal_end",
    )

    def __init__(self, schedule_dir: Path, start_ms: int) -> None:
        self.start_ms = start_ms
        self.directory = schedule_dir / bucket_dir_name(start_ms)
        self.count = 0
        self.nbytes = 0
        self.flushed_count = 0
        self.flushed_bytes = 0
        self.dispatched = 0
        self.dispatch_damaged = 0
        self._dispatch_damage_seen = False  # the damage of the current dispatch log is counted
        self.min_due_ms = 0
        self.wal_end = 0  # end offset of the last write-ahead log record replayed into it
        self.loaded = False  # its undispatched messages are in the timer
        self.dirty = False  # written since the last checkpoint
        self.unsynced_bytes = 0  # written since its files were last fsynced (or sent to be)
        self.pending_messages = bytearray()
        self.pending_index = bytearray()
        self.pending_ids = bytearray()
        self._messages_fd = -1
        self._dispatch_fd = -1
        # append-only descriptors of the replayer's writes, kept while the schedule's cache says so
        self._messages_wfd = -1
        self._index_wfd = -1
        self._ids_wfd = -1

    @property
    def pending(self) -> int:
        """Messages not yet acknowledged by a broker."""
        return self.count - self.dispatched

    @property
    def writing(self) -> bool:
        """Whether the replayer's descriptors are open."""
        return self._messages_wfd >= 0

    @property
    def buffered_bytes(self) -> int:
        return len(self.pending_messages) + len(self.pending_index) + len(self.pending_ids)

    def create(self) -> None:
        with contextlib.suppress(FileExistsError):
            fileio.mkdir(self.directory)

    def add(
        self, record: bytes | bytearray | memoryview, due_ms: int, wal_end: int, id_hash_: int | None = None
    ) -> tuple[int, int]:
        """Buffer one record due at ``due_ms`` (``id_hash_``: of its id, when known); returns its
        entry number and its offset in ``messages``."""
        entry = self.count
        if entry >= ENTRIES_MAX:
            raise OverflowError(f"time bucket {self.start_ms} holds {entry} messages, the most one can")
        offset = self.nbytes
        size = len(record)
        self.pending_index += INDEX_ENTRY.pack(due_ms, offset, size)
        self.pending_ids += ID_ENTRY.pack(id_hash(record_message_id(record)) if id_hash_ is None else id_hash_)
        self.pending_messages += record
        if not entry or due_ms < self.min_due_ms:
            self.min_due_ms = due_ms
        self.count = entry + 1
        self.nbytes = offset + size
        self.wal_end = wal_end
        return entry, offset

    def add_run(
        self,
        records: bytes | bytearray | memoryview,
        dues: npt.NDArray[np.int64],
        sizes: npt.NDArray[np.int64],
        wal_end: int,
        id_hashes: npt.NDArray[np.uint32] | None = None,
    ) -> tuple[int, npt.NDArray[np.int64]]:
        """Buffer records (back to back, due at ``dues``, ``sizes`` bytes each; ``id_hashes`` of
        their ids, when known).

        Returns the entry number of the first and the offset of each in ``messages``.
        """
        k = len(dues)
        entry = self.count
        if entry + k > ENTRIES_MAX:
            raise OverflowError(f"time bucket {self.start_ms} would hold {entry + k} messages, more than {ENTRIES_MAX}")
        offsets = np.cumsum(sizes) - sizes + self.nbytes
        index = np.empty(k, dtype=INDEX_DTYPE)
        index["due"] = dues
        index["offset"] = offsets
        index["size"] = sizes
        self.pending_index += index.tobytes()
        if id_hashes is None:
            self.pending_ids += record_id_hashes(records, sizes)
        else:
            self.pending_ids += id_hashes.astype(IDS_DTYPE, copy=False).tobytes()
        self.pending_messages += records
        lowest = int(dues.min())
        if not entry or lowest < self.min_due_ms:
            self.min_due_ms = lowest
        self.count = entry + k
        self.nbytes += int(sizes.sum())
        self.wal_end = wal_end
        return entry, offsets

    def flush(self) -> int:
        """Write what is buffered (messages first, then their index entries); returns bytes written."""
        if not self.pending_messages:
            return 0
        written = self.buffered_bytes
        if self._messages_wfd < 0:
            self._messages_wfd = _open_append(self.directory / MESSAGES)
        if self._index_wfd < 0:
            self._index_wfd = _open_append(self.directory / INDEX)
        if self._ids_wfd < 0:
            self._ids_wfd = _open_ids_append(self.directory / IDS)
        try:
            fileio.write_all(self._messages_wfd, self.pending_messages)
            fileio.write_all(self._index_wfd, self.pending_index)
            fileio.write_all(self._ids_wfd, self.pending_ids)
        except OSError as exc:
            # index entries hold offsets counted from the flushed size: a retry must start there
            cut_back(self._messages_wfd, self.flushed_bytes, exc)
            cut_back(self._index_wfd, self.flushed_count * INDEX_ENTRY_BYTES, exc)
            cut_back(self._ids_wfd, HEAD_BYTES + self.flushed_count * ID_ENTRY_BYTES, exc)
            raise
        self.pending_messages = bytearray()
        self.pending_index = bytearray()
        self.pending_ids = bytearray()
        self.flushed_count = self.count
        self.flushed_bytes = self.nbytes
        self.dirty = True
        self.unsynced_bytes += written
        return written

    def read(self, offset: int, size: int) -> bytes:
        """``size`` bytes of ``messages`` at ``offset``: from the file, and what is still buffered from memory."""
        on_disk = max(0, min(size, self.flushed_bytes - offset))
        data = b""
        if on_disk:
            if self._messages_fd < 0:
                self._messages_fd = fileio.open(self.directory / MESSAGES, os.O_RDONLY)
            data = fileio.pread(self._messages_fd, on_disk, offset)
        if on_disk < size:
            at = offset + on_disk - self.flushed_bytes
            data += self.pending_messages[at : at + size - on_disk]
        if len(data) != size:
            raise OSError(f"schedule log {self.directory / MESSAGES} ends before {offset + size}")
        return data

    def append_dispatch(self, entries: bytes) -> None:
        """Append entry numbers (bare u32s) to the dispatch log, each with its CRC."""
        if self._dispatch_fd < 0:
            path = self.directory / DISPATCH
            fd = dispatch_log.open_append(path)
            if fd is None:  # of the old format, or ending inside an entry: written anew first
                self.rewrite_dispatch(self.read_dispatched())
                fd = dispatch_log.open_append(path)
                if fd is None:
                    raise OSError(f"dispatch log {path} was written anew and still cannot be appended to")
            self._dispatch_fd = fd
        fd = self._dispatch_fd
        size = fileio.size(fd)
        try:
            fileio.write_all(fd, dispatch_log.encode(entries))
        except OSError as exc:
            cut_back(fd, size, exc)  # a partial entry would misalign every later one
            raise
        self.dispatched += len(entries) // DISPATCH_ENTRY_BYTES
        self.dirty = True

    def load_index(self, entries: int) -> npt.NDArray[Any]:
        """The first ``entries`` index entries (flushed first), as an array of INDEX_DTYPE."""
        if entries > self.flushed_count:
            self.flush()
        return read_index(self.directory, entries)

    def read_dispatched(self) -> npt.NDArray[np.uint32]:
        """The entry numbers the dispatch log holds (whole entries whose check holds)."""
        return self.read_dispatch_log().entries

    def read_dispatch_log(self) -> DispatchRead:
        """The dispatch log read whole; damaged entries (dropped) are logged and counted once per
        file (may run on a worker thread: it reads the file and sets two fields)."""
        found = dispatch_log.read(self.directory / DISPATCH)
        if (found.damaged or found.header_damaged) and not self._dispatch_damage_seen:
            self._dispatch_damage_seen = True
            self.dispatch_damaged += found.damaged
            log.warning(
                "dispatch log %s: dropped %d entries that failed their CRC check%s; their messages "
                "will be handed over again (the broker's duplicate window drops a repeat)",
                self.directory / DISPATCH,
                found.damaged,
                " (and its damaged file header was read as format version 2's)" if found.header_damaged else "",
            )
        return found

    def rewrite_dispatch(self, entries: npt.NDArray[np.uint32]) -> None:
        """Replace the dispatch log, in the current format (recovery: drop damaged entries and
        those of messages that are no longer there)."""
        self.close()
        dispatch_log.rewrite(self.directory / DISPATCH, entries)
        self._dispatch_damage_seen = False
        self.dispatched = len(entries)

    def truncate(self, nbytes: int, entries: int) -> None:
        """Cut ``messages``, ``index`` and ``ids`` back to a checkpointed size (recovery)."""
        self.close()
        sizes = ((MESSAGES, nbytes), (INDEX, entries * INDEX_ENTRY_BYTES), (IDS, HEAD_BYTES + entries * ID_ENTRY_BYTES))
        for name, size in sizes:
            path = self.directory / name
            with contextlib.suppress(FileNotFoundError):
                if path.stat().st_size > size:
                    fileio.truncate(path, size)
        self.count = self.flushed_count = entries
        self.nbytes = self.flushed_bytes = nbytes

    def file_paths(self) -> list[Path]:
        return [self.directory / MESSAGES, self.directory / INDEX, self.directory / DISPATCH, self.directory / IDS]

    # -- cancels -------------------------------------------------------------------------

    def fill_ids(self) -> int:
        """Make the id file hold one entry per written index entry (recovery): entries missing
        from it (a bucket written before id files existed, or an id file cut short by a crash)
        are rebuilt from the records, extra ones cut; returns how many were rebuilt."""
        have = read_ids(self.directory, IDS)
        entries = self.flushed_count
        if len(have) == entries:
            return 0
        path = self.directory / IDS
        if len(have) > entries:
            fileio.truncate(path, HEAD_BYTES + entries * ID_ENTRY_BYTES)
            return 0
        self.close()
        index = read_index(self.directory, entries)
        fd = fileio.open(self.directory / MESSAGES, os.O_RDONLY)
        try:
            out = bytearray(header(IDS_KIND)) + have.tobytes()
            for offset, size in zip(
                index["offset"][len(have) :].tolist(), index["size"][len(have) :].tolist(), strict=True
            ):
                out += ID_ENTRY.pack(id_hash(record_message_id(fileio.pread(fd, size, offset))))
        finally:
            fileio.close(fd)
        fileio.replace_file(path, bytes(out))
        return entries - len(have)

    def find(self, message_id: bytes, from_entry: int = 0) -> list[int]:
        """Entry numbers, from ``from_entry`` on, of the messages with ``message_id``, written
        or buffered, in entry order (on the loop: it reads the buffers)."""
        found = find_written(self.directory, self.flushed_count, message_id, from_entry)
        first = max(from_entry, self.flushed_count)
        if not self.pending_ids or first >= self.count:
            return found
        skip = first - self.flushed_count
        buffered = np.frombuffer(bytes(self.pending_ids), dtype=IDS_DTYPE)[skip:]
        for at in np.flatnonzero(buffered == id_hash(message_id)).tolist():
            entry = first + at
            _due, offset, size = INDEX_ENTRY.unpack_from(
                self.pending_index, (entry - self.flushed_count) * INDEX_ENTRY_BYTES
            )
            at_buffer = offset - self.flushed_bytes
            if record_message_id(self.pending_messages[at_buffer : at_buffer + size]) == message_id:
                found.append(entry)
        return found

    def close_writers(self) -> None:
        for name in ("_messages_wfd", "_index_wfd", "_ids_wfd"):
            fd = getattr(self, name)
            if fd >= 0:
                fileio.close(fd)
                setattr(self, name, -1)

    def close(self) -> None:
        self.close_writers()
        for name in ("_messages_fd", "_dispatch_fd"):
            fd = getattr(self, name)
            if fd >= 0:
                fileio.close(fd)
                setattr(self, name, -1)

    def remove(self) -> None:
        """Delete the bucket's files and directory."""
        self.close()
        temps = [self.directory / (name + ".tmp") for name in (DISPATCH, IDS, INDEX)]
        for path in [*self.file_paths(), *temps]:
            fileio.unlink(path, missing_ok=True)
        with contextlib.suppress(FileNotFoundError):
            fileio.rmdir(self.directory)


def find_written(directory: Path, entries: int, message_id: bytes, from_entry: int = 0) -> list[int]:
    """Entries in ``[from_entry, entries)`` of a bucket's written files whose message id is
    ``message_id``: a hash of the id file narrows, the record's own id decides. Opens its own
    descriptors and reads only what was written, so it may run on a worker thread while the
    loop appends (FileNotFoundError when the bucket was deleted meanwhile)."""
    if entries <= from_entry:
        return []
    ids = read_ids(directory, IDS)[from_entry:entries]
    candidates = (np.flatnonzero(ids == id_hash(message_id)) + from_entry).tolist()
    if not candidates:
        return []
    out = []
    index_fd = fileio.open(directory / INDEX, os.O_RDONLY)
    try:
        messages_fd = fileio.open(directory / MESSAGES, os.O_RDONLY)
        try:
            for entry in candidates:
                _due, offset, size = INDEX_ENTRY.unpack(
                    fileio.pread(index_fd, INDEX_ENTRY_BYTES, entry * INDEX_ENTRY_BYTES)
                )
                if record_message_id(fileio.pread(messages_fd, size, offset)) == message_id:
                    out.append(entry)
        finally:
            fileio.close(messages_fd)
    finally:
        fileio.close(index_fd)
    return out


def read_index(directory: Path, entries: int) -> npt.NDArray[Any]:
    """The first ``entries`` entries of a bucket's ``index`` file (already written), as INDEX_DTYPE."""
    if not entries:
        return np.empty(0, dtype=INDEX_DTYPE)
    index = np.empty(entries, dtype=INDEX_DTYPE)
    got = fileio.read_into(directory / INDEX, index.view(np.uint8).data)
    if got != index.nbytes:
        raise OSError(f"index {directory / INDEX} holds {got // INDEX_ENTRY_BYTES} entries, {entries} expected")
    return index


def index_faults(index: npt.NDArray[Any], nbytes: int, due_end_ms: int) -> int:
    """How many of a bucket's index entries cannot be right: each record begins where the one
    before it ends (the first at 0, the last ending at ``nbytes``, the size of ``messages``),
    is at least a record header and an empty message long, and is due before ``due_end_ms``
    (the bucket's end: a message joins the bucket of the later of its due and stored times)."""
    if not len(index):
        return 0
    offsets = index["offset"].astype(np.int64)
    sizes = index["size"].astype(np.int64)
    ends = offsets + sizes
    expected = np.empty(len(index), dtype=np.int64)
    expected[0] = 0
    expected[1:] = ends[:-1]
    bad = (offsets != expected) | (sizes < _RECORD_BYTES_MIN) | (index["due"] < 0) | (index["due"] >= due_end_ms)
    faults = int(np.count_nonzero(bad))
    return faults + (1 if int(ends[-1]) != nbytes and not bad[-1] else 0)


def rebuild_index(directory: Path, old: npt.NDArray[Any], nbytes: int) -> tuple[npt.NDArray[Any], list[int]]:
    """A bucket's index made again from its ``messages`` (the first ``nbytes``): entry ``n`` is
    the ``n``-th record, with the due time its message carries. Entry numbers must not move
    (the dispatch log names them), so where a record fails its check the old index says where
    the next good record begins and which entry it is; the damaged entries keep what the old
    index says (their records fail their check at hand-over). Returns the index and the
    damaged entries.
    """
    data = fileio.read_file(directory / MESSAGES)[:nbytes]
    by_offset = {int(o): n for n, o in enumerate(old["offset"].tolist())}
    out = old.copy()
    damaged: list[int] = []
    n = pos = 0
    while pos < nbytes and n < len(out):
        size = _good_record(data, pos)
        if size:
            (due,) = _DELIVER_AT.unpack_from(data, pos + RECORD_HEADER_BYTES + _DELIVER_AT_POS)
            out[n] = (due, pos, size)
            n += 1
            pos += size
            continue
        # a damaged record: resume at the next good one the old index names an entry for
        at = pos + 1
        while at < nbytes:
            at = data.find(_RECORD_MAGIC_BYTES, at)
            if at < 0:
                at = nbytes
                break
            if at in by_offset and by_offset[at] > n and _good_record(data, at):
                break
            at += 1
        m = by_offset[at] if at < nbytes else len(out)
        damaged.extend(range(n, m))
        n, pos = m, at
    if n < len(out):
        damaged.extend(range(n, len(out)))
    return out, damaged


def _good_record(data: bytes, pos: int) -> int:
    """The size of the record at ``data[pos:]`` if it checks out (magic, framing, CRC), else 0."""
    header = read_record_header(data, pos)
    if header is None or header.length < HEADER_BYTES or not record_crc_ok(data, pos, header):
        return 0
    return RECORD_HEADER_BYTES + header.length


def _open_append(path: Path) -> int:
    return fileio.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT)


def _open_ids_append(path: Path) -> int:
    """The id file for appending, its header written first when it is new (or empty)."""
    fd = _open_append(path)
    try:
        if fileio.size(fd) == 0:
            fileio.write_all(fd, header(IDS_KIND))
    except OSError:
        fileio.close(fd)
        raise
    return fd


def fsync_paths(paths: list[Path]) -> None:
    """fsync files by path (from a worker thread); files deleted meanwhile are skipped."""
    for path in paths:
        fileio.fsync_path(path)
