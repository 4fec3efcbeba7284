"""The dispatch log of a time bucket: the entry numbers of its messages done with (acknowledged
by a broker, or cancelled), each with a check of its own.

``dispatch`` sits beside ``messages``, ``index`` and ``ids`` in the bucket's directory
(bucket.py). Format version 2 begins with the store's file header (``qmq.store.file_header``,
kind ``DDSP``); then one 8-byte entry per message done with, in the order they were written,
entry ``k`` at ``16 + k × 8`` (little-endian)::

    0         4         8
    +---------+---------+
    | entry   | crc     |
    +---------+---------+

    entry   u32  the message's entry number in the bucket's ``index``
    crc     u32  CRC32C of the 4 bytes of ``entry``

Why the check: an entry read as done is never handed over again, so a damaged entry that
still reads as a number below the bucket's count would mark a message that was never handed
over as done, and it would be lost. An entry whose CRC fails is dropped instead: its message
is handed over again after a restart, and the broker's duplicate window absorbs the repeat
(at least once). CRC32C detects every error of up to 32 consecutive bits and all but 1 in 2^32
of the rest, so flipped bytes make a wrong but valid-looking entry only by that chance.

Format version 1 (written before this one, no file header) is the bare u32 entry numbers,
4 bytes each with no check; such a file is read as it is, and written anew in version 2 before
anything is appended to it (``open_append``). No version-1 file begins with the header's
magic: its first two entries would be 0x464D5151 and at least 0xFF000000.

Only whole entries count: a tail shorter than an entry (a write cut by a crash) is ignored by
readers and cut by recovery, which writes the log anew without damaged entries (``rewrite``).
On the wire to a slave (replica.py) and in memory, entries are bare u32 numbers
(``ENTRY_DTYPE``); the check exists only in the file.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import numpy.typing as npt

from qmq.store import fileio
from qmq.store.file_header import HEAD, HEAD_BYTES, LEGACY_VERSION, MAGIC, FileKind, head_bytes, header

FORMAT_VERSION = 2
DISPATCH_KIND = FileKind(b"DDSP", FORMAT_VERSION, "dispatch log")
ENTRY_BYTES = 4  # an entry number, in memory and on the wire
ENTRY_DTYPE = np.dtype("<u4")
FILE_DTYPE = np.dtype([("entry", "<u4"), ("crc", "<u4")])
FILE_ENTRY_BYTES = FILE_DTYPE.itemsize  # 8
LEGACY_ENTRY_BYTES = 4

assert FILE_ENTRY_BYTES == 8


def _crc32c_tables() -> tuple[int, npt.NDArray[np.uint32]]:
    """CRC32C (Castagnoli, reflected polynomial 0x82F63B78) of 4 bytes, by slicing: it is
    ``C0 ^ T[0][b0] ^ T[1][b1] ^ T[2][b2] ^ T[3][b3]``, where C0 is the CRC of 4 zero bytes and
    row ``k`` holds what byte ``k`` adds (a CRC is linear in its message bits)."""
    byte = np.arange(256, dtype=np.uint32)
    for _ in range(8):
        byte = np.where(byte & 1, (byte >> 1) ^ np.uint32(0x82F63B78), byte >> 1).astype(np.uint32)
    table = byte.tolist()

    def raw(data: bytes) -> int:  # the register after ``data``, from 0, no final xor
        crc = 0
        for b in data:
            crc = table[(crc ^ b) & 0xFF] ^ (crc >> 8)
        return crc

    zero = raw(b"\xff\xff\xff\xff") ^ 0xFFFF_FFFF  # the all-ones start shifted through 4 zero bytes
    rows = [[raw(bytes(b if i == k else 0 for i in range(4))) for b in range(256)] for k in range(4)]
    return zero, np.array(rows, dtype=np.uint32)


_CRC_OF_ZERO, _SLICES = _crc32c_tables()
_SLICE_LISTS = _SLICES.tolist()
# entries: below this a Python loop is cheaper than numpy's per-call costs (about 16 to 32
# measured under load: 5 us for 1 entry by the loop, 30 us for any few by numpy)
_NUMPY_FROM = 16


def entry_crcs(entries: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint32]:
    """CRC32C of each entry's 4 little-endian bytes (``crc32c.crc32c(struct.pack("<I", e))``),
    computed for the whole array at once: a bucket's log may hold millions of entries, one
    ``crc32c`` call each would take a second."""
    b = np.ascontiguousarray(entries, dtype="<u4").view(np.uint8).reshape(-1, 4)
    s = _SLICES
    crcs: npt.NDArray[np.uint32] = s[0][b[:, 0]] ^ s[1][b[:, 1]] ^ s[2][b[:, 2]] ^ s[3][b[:, 3]]
    return crcs ^ np.uint32(_CRC_OF_ZERO)


def _entry_crc(e: int) -> int:
    s0, s1, s2, s3 = _SLICE_LISTS
    return int(_CRC_OF_ZERO ^ s0[e & 0xFF] ^ s1[e >> 8 & 0xFF] ^ s2[e >> 16 & 0xFF] ^ s3[e >> 24])


def encode(entries: bytes | npt.NDArray[np.uint32]) -> bytes:
    """The file bytes of entry numbers (``entries``: an array, or bare u32 numbers)."""
    numbers = np.frombuffer(entries, dtype=ENTRY_DTYPE) if isinstance(entries, bytes) else entries
    n = len(numbers)
    if n < _NUMPY_FROM:  # the dispatcher's appends: one broker answer's entries
        values = numbers.tolist()
        pairs = [x for e in values for x in (e, _entry_crc(e))]
        return struct.pack(f"<{2 * n}I", *pairs)
    out = np.empty(n, dtype=FILE_DTYPE)
    out["entry"] = numbers
    out["crc"] = entry_crcs(out["entry"])
    return out.tobytes()


@dataclass(frozen=True, slots=True)
class DispatchRead:
    """What one read of a dispatch log found."""

    entries: npt.NDArray[np.uint32]  # the entry numbers whose check holds, in file order
    damaged: int = 0  # entries dropped: their CRC failed
    torn_bytes: int = 0  # bytes after the last whole entry (or of a header cut short)
    version: int = FORMAT_VERSION  # the file's format version (2 when there is no file)
    header_damaged: bool = False  # its header was damaged (read as version 2: see _layout)

    @property
    def clean(self) -> bool:
        """Whether the file is as this version writes it: appending to it is safe as it is."""
        return not (self.damaged or self.torn_bytes or self.header_damaged) and self.version == FORMAT_VERSION


_NONE = np.empty(0, dtype=ENTRY_DTYPE)


def read(path: Path) -> DispatchRead:
    """Every entry of the dispatch log at ``path`` whose check holds (none when there is none)."""
    try:
        raw = fileio.read_file(path)
    except FileNotFoundError:
        return DispatchRead(_NONE)
    layout = _layout(path, raw)
    if layout is None:  # empty, or cut inside its header: it holds nothing yet
        return DispatchRead(_NONE, torn_bytes=len(raw))
    head, version, header_damaged = layout
    body = memoryview(raw)[head:]
    if version == LEGACY_VERSION:
        whole = len(body) - len(body) % LEGACY_ENTRY_BYTES
        entries = np.frombuffer(body[:whole], dtype=ENTRY_DTYPE).copy()
        return DispatchRead(entries, torn_bytes=len(body) - whole, version=version)
    whole = len(body) - len(body) % FILE_ENTRY_BYTES
    stored = np.frombuffer(body[:whole], dtype=FILE_DTYPE)
    good = entry_crcs(stored["entry"]) == stored["crc"]
    entries = stored["entry"][good].astype(ENTRY_DTYPE)
    damaged = int(len(stored) - np.count_nonzero(good))
    return DispatchRead(entries, damaged, len(body) - whole, version, header_damaged)


# a format version above this in an intact magic's header is damage, not a newer qmq's file
_VERSION_PLAUSIBLE_MAX = 0xFFFF
# bytes of a 16-byte header still as written when at most 8 of them were damaged
_HEADER_BYTES_KEPT_MIN = 8


def _layout(path: Path, raw: bytes) -> tuple[int, int, bool] | None:
    """Where the entries begin, the format version, and whether the header was damaged; None
    for a file that holds nothing yet.

    A damaged header must not make a version-2 file read as version 1 (its CRCs, and its
    header's version 2, would read as entry numbers, marking messages done that were never
    handed over), nor stop the server. So a file whose first 16 bytes keep at least 8 of the
    header's (any 8 flipped bytes leave that many; entry numbers of a version-1 file would have
    to spell most of ``QMQFILE\xffDDSP``), or whose header has the magic and a version no qmq
    writes, is read as version 2 with its header damaged. A header of an intact magic with
    another kind, or a plausible newer version, is refused as ``head_bytes`` says.
    """
    first = raw[:HEAD_BYTES]
    if len(first) == HEAD_BYTES:
        kept = sum(a == b for a, b in zip(first, header(DISPATCH_KIND), strict=True))
        _magic, _tag, version = HEAD.unpack(first)
        if first.startswith(MAGIC):
            if version > _VERSION_PLAUSIBLE_MAX and kept >= _HEADER_BYTES_KEPT_MIN:
                return HEAD_BYTES, FORMAT_VERSION, True
        elif kept >= _HEADER_BYTES_KEPT_MIN:
            return HEAD_BYTES, FORMAT_VERSION, True
    head = head_bytes(path, first, DISPATCH_KIND)
    if head is None:
        return None
    return (0, LEGACY_VERSION, False) if head == 0 else (head, int(HEAD.unpack_from(raw)[2]), False)


def rewrite(path: Path, entries: npt.NDArray[np.uint32]) -> None:
    """Make the log hold exactly ``entries``, in this version's format (atomically, fsynced)."""
    fileio.replace_file(path, header(DISPATCH_KIND) + encode(entries.astype(ENTRY_DTYPE, copy=False)))


def open_append(path: Path) -> int | None:
    """The log opened for appending in this version's format, its header written first when it
    is new (or empty); None when it must be written anew first (``rewrite``): it is of format
    version 1, its header is damaged, or it ends inside an entry or its header."""
    fd = fileio.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT)
    try:
        size = fileio.size(fd)
        if size == 0:
            fileio.write_all(fd, header(DISPATCH_KIND))
            return fd
        layout = _layout(path, fileio.pread(fd, HEAD_BYTES, 0))
    except Exception:
        fileio.close(fd)
        raise
    if layout is None or layout != (HEAD_BYTES, FORMAT_VERSION, False) or (size - HEAD_BYTES) % FILE_ENTRY_BYTES:
        fileio.close(fd)
        return None
    return fd
