"""The message log: every subject's records in one append-only sequence of segments.

A record is the 28-byte header of ``qmq.protocol.record`` (its layout is drawn there, since
pulls send records as stored) followed by the message exactly as the producer encoded it;
``RECORD_HEADER_DTYPE`` is that header as a numpy record, for checking many at once. A batch
of records is written with one ``write`` and never spans two segments, so every segment
starts on a record boundary. Recovery scans records from a
checkpointed offset and checks each CRC. A record that does not check out is damage when a
good record follows it (a flipped byte, a bad sector): the scan skips to the next record that
checks out, finding it by its magic and CRC, and reports the damaged bytes; one that no good
record follows begins a torn tail, which recovery cuts.

Format version 1: each segment file begins with the header of ``file_header.py`` (kind
``MLOG``), then records back to back. A record's magic "QMR1" also names its layout's version.
"""

from __future__ import annotations

import bisect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import numpy as np

from qmq.protocol.record import (
    RECORD_HEADER,
    RECORD_HEADER_BYTES,
    RECORD_MAGIC,
    read_record_header,
    record_crc_ok,
)
from qmq.store.datadir import StoreError
from qmq.store.file_header import FileKind
from qmq.store.segments import SegmentedLog

log = logging.getLogger(__name__)

FORMAT_VERSION = 1
FILE_KIND = FileKind(b"MLOG", FORMAT_VERSION, "message-log segment")
SEGMENT_SUFFIX = ".log"
RECORD_HEADER_DTYPE = np.dtype(
    [("magic", "<u4"), ("crc", "<u4"), ("length", "<u4"), ("sequence", "<u8"), ("stored_ms", "<i8")]
)
assert RECORD_HEADER_DTYPE.itemsize == RECORD_HEADER.size == RECORD_HEADER_BYTES
_SCAN_CHUNK_BYTES = 8 * 1024 * 1024


class ScannedRecord(NamedTuple):
    offset: int
    sequence: int
    stored_ms: int
    message: memoryview  # valid until the scan moves on


class ScanResult(NamedTuple):
    end: int  # offset after the last good record
    torn_bytes: int  # bytes after ``end`` that did not form a good record


class Damage(NamedTuple):
    offset: int  # where the bytes that form no good record begin
    nbytes: int  # how many, up to the next good record


_MAGIC_BYTES = RECORD_MAGIC.to_bytes(4, "little")


@dataclass(slots=True)
class Checked:
    """What recovery learnt of the message log's records: those from ``crc_from`` on passed
    their CRC (or were written since), except the ``damaged`` bytes (in order of offset)."""

    crc_from: int = 0
    damaged: list[Damage] = field(default_factory=list)

    def is_damaged(self, offset: int) -> bool:
        """Whether the record at ``offset`` lies in bytes recovery found damaged."""
        at = bisect.bisect_right(self.damaged, offset, key=lambda d: d.offset) - 1
        return at >= 0 and offset < self.damaged[at].offset + self.damaged[at].nbytes


def _read_into(read: Callable[[int, int], bytes], offset: int, size: int, chunks: list[bytes]) -> None:
    while size > 0:
        data = read(offset, size)
        if not data:
            raise StoreError(f"message log has no data at offset {offset} ({size} bytes expected)")
        chunks.append(data)
        offset += len(data)
        size -= len(data)


class MessageLog:
    def __init__(self, directory: Path, segment_bytes: int) -> None:
        self.segments = SegmentedLog(directory, SEGMENT_SUFFIX, segment_bytes, FILE_KIND)

    @property
    def start(self) -> int:
        return self.segments.start

    @property
    def end(self) -> int:
        return self.segments.end

    def append(self, data: bytes | bytearray | memoryview) -> int:
        return self.segments.append(data)

    def offset_for_append(self, size: int) -> int:
        """Where ``size`` bytes appended now will start (rolling the segment first if needed)."""
        self.segments.roll_if_needed(size)
        return self.segments.end

    def read(self, offset: int, size: int) -> bytes:
        return self.segments.read(offset, size)

    def read_into(self, offset: int, size: int, chunks: list[bytes]) -> None:
        """Append the ``size`` bytes at ``offset`` to ``chunks`` (one chunk per segment they span)."""
        _read_into(self.segments.read, offset, size, chunks)

    def reader(self) -> Callable[[int, int, list[bytes]], None]:
        """``read_into`` for the reads one pull makes together (``SegmentedLog.reader``: about a
        third less a read when a subject's records lie apart). Good until the log next changes."""
        read = self.segments.reader()

        def read_run(offset: int, size: int, chunks: list[bytes]) -> None:
            data = read(offset, size)
            if len(data) == size:
                chunks.append(data)
            else:  # across two segments, or a short file: read again piece by piece
                _read_into(read, offset, size, chunks)

        return read_run

    def scan(
        self, start: int, result: list[ScanResult], verify: bool = True, damaged: list[Damage] | None = None
    ) -> Iterator[ScannedRecord]:
        """Yield the records from ``start`` to the end; append one ScanResult to ``result`` at the end.

        With ``verify`` every CRC is checked and the scan stops at the first bad or partial
        record; without it only the framing is checked (for data known to be good). With
        ``damaged`` (and ``verify``) a bad record that a good one follows does not stop the
        scan: it goes on from that good record (``next_good``) and the bytes between are
        appended to ``damaged``; only bytes that no good record follows are a torn tail.
        """
        torn = 0
        pos_global = max(start, self.start)
        for seg in list(self.segments.segments):
            if seg.end <= pos_global:
                continue
            pos = pos_global - seg.base
            while pos < seg.size:
                chunk = self.segments.read(seg.base + pos, _SCAN_CHUNK_BYTES)
                view = memoryview(chunk)
                p = 0
                bad = False
                while p < len(chunk):
                    header = read_record_header(chunk, p)
                    if header is None:
                        if len(chunk) - p >= RECORD_HEADER_BYTES or seg.base + pos + len(chunk) >= seg.end:
                            bad = True
                        break
                    rec_end = p + RECORD_HEADER_BYTES + header.length
                    if rec_end > len(chunk):
                        if seg.base + pos + len(chunk) >= seg.end or header.length > _SCAN_CHUNK_BYTES:
                            bad = True
                        break
                    if verify and not record_crc_ok(chunk, p, header):
                        bad = True
                        break
                    yield ScannedRecord(
                        seg.base + pos + p,
                        header.sequence,
                        header.stored_ms,
                        view[p + RECORD_HEADER_BYTES : rec_end],
                    )
                    p = rec_end
                if bad:
                    good_end = seg.base + pos + p
                    again = self.next_good(good_end) if damaged is not None and verify else None
                    if again is not None and damaged is not None:
                        damaged.append(Damage(good_end, again - good_end))
                        pos = again - seg.base
                        if again >= seg.end:
                            break
                        continue
                    torn = self.end - good_end
                    result.append(ScanResult(good_end, torn))
                    return
                if p == 0:
                    # A record larger than the chunk cannot happen (batches are smaller); treat as torn.
                    good_end = seg.base + pos
                    result.append(ScanResult(good_end, self.end - good_end))
                    return
                pos += p
            pos_global = seg.end
        result.append(ScanResult(self.end, torn))

    def next_good(self, offset: int) -> int | None:
        """Where the first record after ``offset`` that checks out (magic, framing, CRC) begins,
        or the next segment's start (every segment begins on a record boundary); None when no
        good record follows ``offset`` in the log."""
        seg = self.segments.segment_for(offset)
        if seg is None:
            return None
        at = offset + 1
        while at < seg.end:
            chunk = self.segments.read(at, _SCAN_CHUNK_BYTES)
            if not chunk:
                break
            p = chunk.find(_MAGIC_BYTES)
            while p >= 0:
                header = read_record_header(chunk, p)
                if header is not None and p + RECORD_HEADER_BYTES + header.length <= len(chunk):
                    if record_crc_ok(chunk, p, header):
                        return at + p
                elif header is not None and at + p + RECORD_HEADER_BYTES + header.length <= seg.end:
                    data = self.segments.read(at + p, RECORD_HEADER_BYTES + header.length)
                    if record_crc_ok(data, 0, header):
                        return at + p
                p = chunk.find(_MAGIC_BYTES, p + 1)
            # a magic cut by the chunk's end is looked at again from the next chunk
            at += max(1, len(chunk) - len(_MAGIC_BYTES) + 1)
        return seg.end if seg is not self.segments.segments[-1] else None

    def truncate(self, offset: int) -> int:
        return self.segments.truncate(offset)

    def close(self) -> None:
        self.segments.close()
