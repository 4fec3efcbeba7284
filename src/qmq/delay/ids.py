"""The id file of a time bucket: a 32-bit hash of each message's id, entry by entry, so a cancel
finds a message by its id without reading the messages themselves.

``ids`` sits beside ``messages``, ``index`` and ``dispatch`` in the bucket's directory
(bucket.py) and begins with the store's file header (``qmq.store.file_header``, kind
``DIDS``, format version 1); then one entry per ``index`` entry, entry ``n`` at ``16 + n × 4``::

    0         4
    +---------+
    | id_crc  |   u32  CRC32C of the message id's UTF-8 bytes (little-endian)
    +---------+

A hash narrows the search; each candidate's record is then read and its id compared, so two
ids with one hash never cancel each other. The file is appended with ``index`` (after it), and
cut back and fsynced with it; a bucket written before id files existed, or whose id file ends
short after a crash, has the missing entries rebuilt from its records when it is opened
(``Bucket.fill_ids``).
"""

from __future__ import annotations

import struct
from pathlib import Path

import crc32c
import numpy as np
import numpy.typing as npt

from qmq.protocol.message import HEADER_BYTES
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store import fileio
from qmq.store.file_header import HEAD_BYTES, FileKind, head_bytes

FORMAT_VERSION = 1
IDS_KIND = FileKind(b"DIDS", FORMAT_VERSION, "schedule-log id file")
ID_ENTRY = struct.Struct("<I")
ID_ENTRY_BYTES = ID_ENTRY.size  # 4
IDS_DTYPE = np.dtype("<u4")


def id_hash(message_id: bytes) -> int:
    """The hash an id file holds for ``message_id``."""
    return int(crc32c.crc32c(message_id))


def record_message_id(record: bytes | bytearray | memoryview, at: int = 0) -> bytes:
    """The message id of the schedule-log record at ``record[at:]`` (qmq.protocol.record, then
    qmq.protocol.message: subj_len is a u16 at 2, id_l a u8 at 4 of the message header); empty
    for a record too short to hold one (a damaged one: the hand-over skips it by its CRC)."""
    m = at + RECORD_HEADER_BYTES
    if m + HEADER_BYTES > len(record):
        return b""
    slen = record[m + 2] | record[m + 3] << 8
    start = m + HEADER_BYTES + slen
    return bytes(record[start : start + record[m + 4]])


def record_id_hashes(records: bytes | bytearray | memoryview, sizes: npt.NDArray[np.int64]) -> bytes:
    """The id-file entries of records back to back in ``records``, ``sizes`` bytes each: where
    each id lies is found with numpy, then one CRC32C call per id (about 0.2 us a message)."""
    if not len(sizes):
        return b""
    buf = np.frombuffer(records, dtype=np.uint8)
    at = np.cumsum(sizes) - sizes + RECORD_HEADER_BYTES  # each message's header
    slen = buf[at + 2].astype(np.int64) | buf[at + 3].astype(np.int64) << 8
    starts = at + HEADER_BYTES + slen
    ends = starts + buf[at + 4]
    view = memoryview(records)
    crc = crc32c.crc32c
    hashes = [crc(view[a:b]) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]
    return np.array(hashes, dtype=IDS_DTYPE).tobytes()


def read_ids(directory: Path, name: str) -> npt.NDArray[np.uint32]:
    """Every whole entry of a bucket's id file (none when it is missing or holds only a header)."""
    path = directory / name
    try:
        raw = fileio.read_file(path)
    except FileNotFoundError:
        return np.empty(0, dtype=IDS_DTYPE)
    head = head_bytes(path, raw[:HEAD_BYTES], IDS_KIND)
    if head is None or head == 0:
        return np.empty(0, dtype=IDS_DTYPE)  # cut inside its header; or never had one: rebuilt
    body = raw[head:]
    return np.frombuffer(body, dtype=IDS_DTYPE, count=len(body) // ID_ENTRY_BYTES)
