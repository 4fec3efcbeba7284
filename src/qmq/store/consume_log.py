"""The consume log of one subject: its entry format, and the log of one subject's entries.

This module is the one home of the entry layout: the struct, the numpy dtype and the field
numbers below are what every reader of consume logs uses (the store's pulls, recovery,
retention, retries, and the offline reader in ``reader.py``).

Entry layout, format version 1 (little-endian, 32 bytes; entry N at log offset N × 32)::

    0                 8         12                20                28        32
    +-----------------+---------+-----------------+-----------------+---------+
    | log offset      | size    | stored_ms       | tag bloom       |ord_slot |
    +-----------------+---------+-----------------+-----------------+---------+

    | field      | type | bytes  | meaning                                               |
    |------------|------|--------|-------------------------------------------------------|
    | log offset | u64  | 0-7    | where the record starts in the message log            |
    | size       | u32  | 8-11   | bytes of the record (28-byte header + message)        |
    | stored_ms  | i64  | 12-19  | when the broker stored it                             |
    | tag bloom  | u64  | 20-27  | two bits per tag (``tag_bloom``); 0 without tags      |
    | order_slot | u32  | 28-31  | the order-key slot + 1 of a message with FLAG_ORDERED |
    |            |      |        | (protocol.message.order_slot_field); 0 without an order  |
    |            |      |        | key (and in every entry written before ordered        |
    |            |      |        | messages, when this field was reserved and 0)         |

Each segment file begins with the header of ``file_header.py`` (kind ``CLOG``, the format
version), then entries; files written before headers hold entries only. A new layout needs a
new version here. Along a subject, log offsets and stored times never go back.

The consume log is derived: recovery rebuilds its tail from the message log, and an entry a
pull finds disagreeing with the record it points at is rewritten from the message log
(clog_repair.py). Its segment
files are named by their base byte offset (entry number × 32), like the message log's.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Callable
from pathlib import Path

import crc32c
import numpy as np

from qmq.common.naming import subject_of_file_name
from qmq.store import fileio
from qmq.store.file_header import FileKind, read_head
from qmq.store.fileio import StrPath
from qmq.store.open_files import OpenFiles
from qmq.store.segments import SegmentedLog, segment_base

FORMAT_VERSION = 1
FILE_KIND = FileKind(b"CLOG", FORMAT_VERSION, "consume-log segment")
ENTRY = struct.Struct("<QIqQI")
ENTRY_BYTES = ENTRY.size  # 32
# the same layout as a numpy record, for reading many entries at once
ENTRY_DTYPE = np.dtype(
    [("offset", "<u8"), ("size", "<u4"), ("stored_ms", "<i8"), ("bloom", "<u8"), ("reserved", "<u4")]
)
assert ENTRY_DTYPE.itemsize == ENTRY_BYTES
# positions in an unpacked ENTRY
FIELD_OFFSET = 0
FIELD_STORED_MS = 2
SUBJECT_FILE = "subject"
SEGMENT_SUFFIX = ".cl"


def tag_bloom(tags_block: bytes) -> int:
    """Two bits of a 64-bit mask for each tag in an encoded tag block (u8 length + bytes, repeated)."""
    bloom = 0
    pos = 0
    while pos < len(tags_block):
        n = tags_block[pos]
        bloom |= tag_bits(tags_block[pos + 1 : pos + 1 + n])
        pos += 1 + n
    return bloom


def tag_bits(tag: bytes) -> int:
    h = crc32c.crc32c(tag)
    return (1 << (h & 63)) | (1 << ((h >> 6) & 63))


def first_seq_reaching(read: Callable[[int, int], bytes], lo: int, hi: int, field: int, value: int) -> int:
    """The first sequence in ``[lo, hi)`` whose entry's ``field`` (``FIELD_OFFSET`` or
    ``FIELD_STORED_MS``, which never go back along a subject) is at least ``value``; ``hi``
    when none is. ``read(seq, count)`` gives entries; one it cannot give counts as reaching.
    A binary search: O(log n) reads."""
    while lo < hi:
        mid = (lo + hi) // 2
        raw = read(mid, 1)
        if len(raw) == ENTRY_BYTES and ENTRY.unpack(raw)[field] < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


class ConsumeLog:
    """One subject's entries. With ``files`` (the broker's), its segment files are opened when
    used and closed within that bound (see open_files.py).

    A consume log found by recovery (``names`` given) in one whole segment file is checked at
    once (its header, its size, where its last entry's record ends: a descriptor opened, read
    and closed) but its segments are set up on first use (``segments``): with 40,000 subjects,
    most are idle after a restart, and setting up each one's segments cost most of recovery.
    A log that needs a repair (a torn last entry, a file cut inside its header) or holds more
    than one segment is set up at once, as a new one is.
    """

    # one per subject: slots and a str directory keep an idle one small
    __slots__ = ("_dir", "_end", "_files", "_last_record_end", "_segment_bytes", "_segments", "_start", "subject")

    def __init__(
        self,
        directory: StrPath,
        subject: str,
        entries_per_segment: int,
        files: OpenFiles | None = None,
        names: list[str] | None = None,
    ) -> None:
        """``names``: what ``directory`` holds, when the caller listed it already (recovery's
        ``Subjects.open_all``); otherwise the directory is made if it is not there."""
        self._dir = dir_name = str(directory)
        self.subject = subject
        # A new subject costs a few file-system calls, each tens of microseconds on a quiet disk
        # and near a millisecond under a load of fsyncs: no more than needed. Its directory's name
        # says its subject (subject_of_file_name), so the subject file is written only for a name
        # that does not (cut and hashed); a segment file is made now, so the directory is found
        # again by recovery (subject_in).
        new = False
        if names is None:
            try:
                fileio.mkdir(dir_name)
                new = True
                names = []
            except FileExistsError:
                pass
            except FileNotFoundError:
                fileio.make_dirs(dir_name)
                new = True
                names = []
        name_file = f"{dir_name}/{SUBJECT_FILE}"
        if subject_of_file_name(os.path.basename(dir_name)) != subject and (new or not os.path.exists(name_file)):
            tmp = name_file + ".tmp"
            fd = fileio.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            try:
                fileio.write_all(fd, subject.encode("utf-8"))
            finally:
                fileio.close(fd)
            fileio.replace(tmp, name_file)
        self._segment_bytes = entries_per_segment * ENTRY_BYTES
        self._files = files
        self._segments: SegmentedLog | None = None
        # where the last entry's record ends, read now while the file is open (see cut_past)
        self._last_record_end: int | None = None
        if names is not None and self._checked_whole(names):
            return
        segments = self._segments = SegmentedLog(
            dir_name, SEGMENT_SUFFIX, self._segment_bytes, FILE_KIND, files, names=names
        )
        partial = segments.end % ENTRY_BYTES
        if partial:  # a torn last entry: appends must start on an entry boundary
            segments.truncate(segments.end - partial)
        last = self.last_entry()
        self._last_record_end = 0 if last is None else last[0] + last[1]

    def _checked_whole(self, names: list[str]) -> bool:
        """Whether the log in ``names`` is one segment file that needs no repair; if so, its
        bounds (``_start``, ``_end``) and ``_last_record_end``, read without setting it up."""
        found = [n for n in names if n.endswith(SEGMENT_SUFFIX)]
        base = segment_base(found[0], SEGMENT_SUFFIX) if len(found) == 1 else None
        if base is None:
            return False
        path = f"{self._dir}/{found[0]}"
        fd = fileio.open(path, os.O_RDONLY)
        try:
            head = read_head(fd, path, FILE_KIND)  # a file of another kind or version is refused now
            if head is None:
                return False
            size = fileio.size(fd) - head
            if size % ENTRY_BYTES:
                return False
            last = fileio.pread(fd, ENTRY_BYTES, head + size - ENTRY_BYTES) if size else b""
        finally:
            fileio.close(fd)
        if size and len(last) != ENTRY_BYTES:
            return False
        self._start = base
        self._end = base + size
        if last:
            offset, nbytes, _ms, _bloom, _slot = ENTRY.unpack(last)
            self._last_record_end = offset + nbytes
        else:
            self._last_record_end = 0
        return True

    @property
    def segments(self) -> SegmentedLog:
        """The log's segment files, set up now if they were not yet (see the class docstring)."""
        segments = self._segments
        if segments is None:
            segments = self._segments = SegmentedLog(
                self._dir, SEGMENT_SUFFIX, self._segment_bytes, FILE_KIND, self._files
            )
        return segments

    @property
    def directory(self) -> Path:
        return Path(self._dir)

    @staticmethod
    def subject_in(directory: StrPath, names: list[str] | None = None) -> str | None:
        """The subject whose consume log ``directory`` holds (``names``: what it holds, when
        listed already): the one its subject file names, else the one its own name says when it
        holds a segment file; None for a directory that is no consume log."""
        if names is None:
            try:
                names = fileio.listdir(directory)
            except (FileNotFoundError, NotADirectoryError):
                return None
        if SUBJECT_FILE in names:
            try:
                return fileio.read_text(f"{directory}/{SUBJECT_FILE}")
            except FileNotFoundError:
                return None
        if any(n.endswith(SEGMENT_SUFFIX) for n in names):
            return subject_of_file_name(os.path.basename(directory))
        return None

    @property
    def next_seq(self) -> int:
        segments = self._segments
        return (self._end if segments is None else segments.end) // ENTRY_BYTES

    @property
    def min_seq(self) -> int:
        segments = self._segments
        return (self._start if segments is None else segments.start) // ENTRY_BYTES

    def append(self, entries: bytes | bytearray) -> None:
        self.segments.append(entries)
        self._last_record_end = None

    def read(self, seq: int, count: int) -> bytes:
        """Up to ``count`` entries from ``seq`` (fewer at the end of the log)."""
        want = count * ENTRY_BYTES
        offset = seq * ENTRY_BYTES
        out = self.segments.read(offset, want)
        while len(out) < want:
            more = self.segments.read(offset + len(out), want - len(out))
            if not more:
                break
            out += more
        return out

    def overwrite(self, seq: int, entry: bytes) -> None:
        """Write one entry in place over entry ``seq`` (a repair: see clog_repair.py)."""
        offset = seq * ENTRY_BYTES
        seg = self.segments.segment_for(offset)
        if seg is None or offset + len(entry) > seg.end:
            raise ValueError(f"consume log of {self.subject!r} has no entry {seq} to overwrite")
        fd = fileio.open(seg.path, os.O_WRONLY)  # the segments' own descriptors append only
        try:
            fileio.pwrite_all(fd, entry, seg.head + offset - seg.base)
        finally:
            fileio.close(fd)

    def last_entry(self) -> tuple[int, int, int, int, int] | None:
        if self.next_seq == self.min_seq:
            return None
        raw = self.read(self.next_seq - 1, 1)
        return ENTRY.unpack(raw) if len(raw) == ENTRY_BYTES else None

    def seq_at_time(self, time_ms: int) -> int:
        """The first sequence stored at or after ``time_ms``."""
        return first_seq_reaching(self.read, self.min_seq, self.next_seq, FIELD_STORED_MS, time_ms)

    def truncate(self, seq: int) -> int:
        """Drop entries from ``seq`` on; returns how many were dropped."""
        self._last_record_end = None
        return self.segments.truncate(seq * ENTRY_BYTES) // ENTRY_BYTES

    def cut_past(self, log_end: int) -> int:
        """Drop the entries at the end whose record lies past ``log_end`` (the message log's end
        after recovery cut a torn tail); returns how many were dropped."""
        if self._last_record_end is not None and self._last_record_end <= log_end:
            return 0  # known without reading: with many subjects, most files are closed by now
        cut = 0
        while self.next_seq > self.min_seq:
            back = min(1024, self.next_seq - self.min_seq)
            raw = self.read(self.next_seq - back, back)
            keep = 0
            for i, (off, size, _ms, _bloom, _r) in enumerate(ENTRY.iter_unpack(raw)):
                if off + size > log_end:
                    break
                keep = i + 1
            if keep == back:
                break
            cut += self.truncate(self.next_seq - back + keep)
            if keep:
                break
        return cut

    def delete_before_offset(self, log_offset: int) -> None:
        """Delete whole segments (never the last) whose every entry points before ``log_offset``
        in the message log (retention deleted those records)."""
        if self._segments is None:
            return  # one segment, not set up yet: nothing to delete
        for seg in self.segments.segments[:-1]:
            last = self.read(seg.end // ENTRY_BYTES - 1, 1)
            if len(last) == ENTRY_BYTES and ENTRY.unpack(last)[FIELD_OFFSET] < log_offset:
                self.segments.delete_before(seg.end)
            else:
                break

    def close(self) -> None:
        if self._segments is not None:
            self._segments.close()
