"""The consume log of one subject: fixed-width entries, entry N at byte N × 32.

Entry layout (little-endian, 32 bytes)::

    0                 8         12                20                28        32
    +-----------------+---------+-----------------+-----------------+---------+
    | log offset      | size    | stored_ms       | tag bloom       |reserved |
    +-----------------+---------+-----------------+-----------------+---------+

    log offset  u64  where the record starts in the message log
    size        u32  bytes of the record (28-byte header + message)
    stored_ms   i64  when the broker stored it
    tag bloom   u64  two bits per tag (see ``tag_bloom``); 0 for a message without tags
    reserved    u32  0

The consume log is derived: recovery rebuilds its tail from the message log. Its segment
files are named by their base byte offset (entry number × 32), like the message log's.
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c

from qmq.store.segments import SegmentedLog

ENTRY = struct.Struct("<QIqQI")
ENTRY_BYTES = ENTRY.size  # 32
SUBJECT_FILE = "subject"


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


class ConsumeLog:
    def __init__(self, directory: Path, subject: str, entries_per_segment: int) -> None:
        self.directory = directory
        self.subject = subject
        directory.mkdir(parents=True, exist_ok=True)
        name_file = directory / SUBJECT_FILE
        if not name_file.exists():
            tmp = directory / (SUBJECT_FILE + ".tmp")
            tmp.write_text(subject, encoding="utf-8")
            tmp.replace(name_file)
        self.segments = SegmentedLog(directory, ".cl", entries_per_segment * ENTRY_BYTES)

    @staticmethod
    def subject_in(directory: Path) -> str | None:
        try:
            return (directory / SUBJECT_FILE).read_text(encoding="utf-8")
        except FileNotFoundError:
            return None

    @property
    def next_seq(self) -> int:
        return self.segments.end // ENTRY_BYTES

    @property
    def min_seq(self) -> int:
        return self.segments.start // ENTRY_BYTES

    def append(self, entries: bytes | bytearray) -> None:
        self.segments.append(entries)

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

    def last_entry(self) -> tuple[int, int, int, int, int] | None:
        if self.next_seq == self.min_seq:
            return None
        raw = self.read(self.next_seq - 1, 1)
        return ENTRY.unpack(raw) if len(raw) == ENTRY_BYTES else None

    def seq_at_time(self, time_ms: int) -> int:
        """The first sequence stored at or after ``time_ms`` (stored times never go back within a subject)."""
        lo, hi = self.min_seq, self.next_seq
        while lo < hi:
            mid = (lo + hi) // 2
            raw = self.read(mid, 1)
            if len(raw) == ENTRY_BYTES and ENTRY.unpack(raw)[2] < time_ms:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def truncate(self, seq: int) -> int:
        """Drop entries from ``seq`` on; returns how many were dropped."""
        return self.segments.truncate(seq * ENTRY_BYTES) // ENTRY_BYTES

    def delete_before_seq(self, seq: int) -> None:
        self.segments.delete_before(seq * ENTRY_BYTES)

    def close(self) -> None:
        self.segments.close()
