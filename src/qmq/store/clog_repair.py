"""Checking consume-log entries against their records, and rewriting the ones that disagree.

A consume-log entry (consume_log.py) names a message-log record by offset and size and repeats
its stored time; the record's header (qmq.protocol.record) holds its length, its sequence —
the entry's place in the log — and its stored time, under a CRC. A pull checks every record it
reads against the entry that named it (``check_record``): an entry that disagrees was damaged
(a flipped byte in the consume log), and since consume logs are derived from the message log,
``repair`` rewrites it, and every other entry of the subject from there on that disagrees, from
the records themselves. A record that agrees with its entry but fails its CRC was damaged in the
message log: it cannot be rebuilt (without a slave), so it is never handed out.

The repair scans the message log from the end of the last entry before the damage that agrees
with its record (looked for at most ``_BACK_ENTRIES_MAX`` entries back; else from the log's
start), skipping damaged records (message_log.py), until it has seen every record it looks
for. Entries are rewritten in place (the message log is not touched).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import crc32c

from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import HEADER_BYTES, order_slot_field, scan_batch
from qmq.protocol.record import RECORD_HEADER, RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, ConsumeLog, tag_bloom
from qmq.store.message_log import Damage, MessageLog, ScanResult

log = logging.getLogger(__name__)

_BACK_ENTRIES_MAX = 64

# what check_record finds
GOOD = 0
DISAGREES = 1  # the entry and the record's header differ: the entry (or the header) is damaged
DAMAGED = 2  # the header agrees, the CRC fails: the record is damaged


def check_record(data: bytes, pos: int, size: int, seq: int, stored_ms: int) -> int:
    """How the record at ``data[pos:]`` compares with an entry naming it: ``size`` bytes,
    sequence ``seq``, stored at ``stored_ms``."""
    end = pos + size
    if size < RECORD_HEADER_BYTES or end > len(data):
        return DISAGREES
    magic, crc, length, sequence, ms = RECORD_HEADER.unpack_from(data, pos)
    if magic != RECORD_MAGIC or length + RECORD_HEADER_BYTES != size or sequence != seq or ms != stored_ms:
        return DISAGREES
    if crc32c.crc32c(memoryview(data)[pos + 8 : end]) != crc:
        return DAMAGED
    return GOOD


class Repair(NamedTuple):
    rewritten: int  # entries rewritten from their records
    missing: int  # entries looked for whose record was not found whole (damaged in the message log)
    scanned_bytes: int


def _entry_agrees(clog: ConsumeLog, mlog: MessageLog, seq: int) -> int | None:
    """Where the record of entry ``seq`` ends, if the entry agrees with the record's header."""
    raw = clog.read(seq, 1)
    if len(raw) != ENTRY_BYTES:
        return None
    off, size, ms, _bloom, _slot = ENTRY.unpack(raw)
    if off < mlog.start or size < RECORD_HEADER_BYTES or off + size > mlog.end:
        return None
    head = mlog.read(off, RECORD_HEADER_BYTES)
    if len(head) != RECORD_HEADER_BYTES:
        return None
    magic, _crc, length, sequence, stored = RECORD_HEADER.unpack(head)
    if magic != RECORD_MAGIC or length + RECORD_HEADER_BYTES != size or sequence != seq or stored != ms:
        return None
    return int(off + size)


def repair(clog: ConsumeLog, mlog: MessageLog, from_seq: int, end_seq: int) -> Repair:
    """Rewrite the entries of ``clog`` in ``[from_seq, end_seq)`` that differ from what their
    records say (see the module docstring)."""
    start = mlog.start
    back = from_seq - 1
    while back >= max(clog.min_seq, from_seq - _BACK_ENTRIES_MAX):
        end = _entry_agrees(clog, mlog, back)
        if end is not None:
            start = end
            break
        back -= 1
    want = clog.subject.encode("utf-8")
    slen = len(want)
    wanted = end_seq - from_seq
    found = rewritten = 0
    result: list[ScanResult] = []
    damaged: list[Damage] = []
    last = start
    for rec in mlog.scan(start, result, damaged=damaged):
        seq = rec.sequence
        last = rec.offset
        if seq < from_seq or seq >= end_seq:
            continue
        m = rec.message
        if len(m) < HEADER_BYTES + slen or (m[2] | m[3] << 8) != slen or m[HEADER_BYTES : HEADER_BYTES + slen] != want:
            continue
        try:
            (sm,) = scan_batch(bytes(m))
        except (RemoteProtocolError, ValueError):
            continue  # passes its CRC but is no message of this version: left as it is
        entry = ENTRY.pack(
            rec.offset, RECORD_HEADER_BYTES + len(m), rec.stored_ms, tag_bloom(sm.tags), order_slot_field(m)
        )
        if clog.read(seq, 1) != entry:
            clog.overwrite(seq, entry)
            rewritten += 1
        found += 1
        if found >= wanted:
            break
    return Repair(rewritten, wanted - found, max(0, last - start))
