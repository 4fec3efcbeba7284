"""The header every data file of a store begins with: what kind of file it is and the version
of its format, so a qmq never reads, or cuts, a file that another version wrote.

Layout (16 bytes, little-endian)::

    0                           8         12        16
    +---------------------------+---------+---------+
    | magic b"QMQFILE\\xff"      | kind    | version |
    +---------------------------+---------+---------+

    | field   | type     | bytes | meaning                                                |
    |---------|----------|-------|--------------------------------------------------------|
    | magic   | 8 bytes  | 0-7   | b"QMQFILE\\xff"                                         |
    | kind    | 4 bytes  | 8-11  | ASCII, e.g. b"MLOG"; each file format's module names it |
    | version | u32      | 12-15 | the format version of what follows                     |

Files written before headers existed begin with their data and are read as format version 1.
No such file begins with the magic: message-log records and dead letters begin with the
record magic "QMR1"; consume-log entries and removed dead letters with a u64 offset, and an
action-log frame with a u32 length, whose top byte would be 0xff or whose size would be 1.2 GB.

Offsets in a log never count the header: a segment's data begins after it.
"""

from __future__ import annotations

import struct
from typing import NamedTuple

from qmq.store import fileio
from qmq.store.datadir import StoreError
from qmq.store.fileio import StrPath

MAGIC = b"QMQFILE\xff"
HEAD = struct.Struct("<8s4sI")
HEAD_BYTES = HEAD.size  # 16
LEGACY_VERSION = 1  # what a file without a header holds


class FileKind(NamedTuple):
    tag: bytes  # 4 ASCII bytes
    version: int  # the format version this qmq writes, and the newest it reads
    name: str  # for errors, e.g. "message-log segment"


class FileFormatError(StoreError):
    """A file holds another kind of data, or a format version this qmq does not read."""


def header(kind: FileKind) -> bytes:
    return HEAD.pack(MAGIC, kind.tag, kind.version)


def head_bytes(path: StrPath, first: bytes, kind: FileKind) -> int | None:
    """Bytes of the header at the start of ``path``, whose first bytes are ``first`` (at least
    ``HEAD_BYTES`` of them when the file has that many): ``HEAD_BYTES``, 0 for a file written
    before headers, or None for a file cut inside its header (or empty), which holds no data.

    Raises FileFormatError for a file of another kind or of a newer format version.
    """
    if len(first) < HEAD_BYTES:
        n = len(first)
        return None if first == MAGIC[:n] or (n > len(MAGIC) and first[: len(MAGIC)] == MAGIC) else 0
    if first[: len(MAGIC)] != MAGIC:
        return 0
    _magic, tag, version = HEAD.unpack_from(first)
    if tag != kind.tag:
        raise FileFormatError(
            f"{path} is not a {kind.name}: its header names kind {tag!r}, not {kind.tag!r}; "
            "a file of another kind was put there: move it out of the data directory"
        )
    if not LEGACY_VERSION <= version <= kind.version:
        raise FileFormatError(
            f"{path} has format version {version}; this qmq reads {kind.name}s of format versions "
            f"{LEGACY_VERSION} to {kind.version}: run the qmq version that wrote it (or a later one)"
        )
    return HEAD_BYTES


def read_head(fd: int, path: StrPath, kind: FileKind) -> int | None:
    """``head_bytes`` of the open file ``fd``."""
    return head_bytes(path, fileio.pread(fd, HEAD_BYTES, 0), kind)
