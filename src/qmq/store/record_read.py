"""Reading the records a pull hands out, many at once: checked against their consume-log
entries with numpy (``read_fast``, the common case of ``qmq.store.take``), a read's chunks
less the damaged records (``without``), and how many entries a pull's byte budget takes
(``kept_within``). ``crc_from``: the message-log offset below which
recovery did not check CRCs, so these records' CRCs are checked here."""

from __future__ import annotations

import itertools

import crc32c
import numpy as np

from qmq.protocol.record import RECORD_HEADER_BYTES, RECORD_MAGIC
from qmq.store.consume_log import ENTRY, ENTRY_BYTES, ENTRY_DTYPE
from qmq.store.message_log import RECORD_HEADER_DTYPE, MessageLog

_HEADER_SPAN = np.arange(RECORD_HEADER_BYTES)
FAST_ENTRIES_MIN = 128  # from this many entries a pull's records are checked with numpy


def kept_within(entries: bytes, log_start: int, budget: int) -> tuple[int, int]:
    """How many leading ``entries`` name records retention removed (below ``log_start``), and how
    many of the rest fit ``budget`` bytes (the first always does): one pass, with numpy for many."""
    n = len(entries) // ENTRY_BYTES
    if n >= FAST_ENTRIES_MIN:
        e = np.frombuffer(entries, dtype=ENTRY_DTYPE)
        kept = e["offset"] >= log_start
        if not kept.any():
            return n, 0
        skip = int(kept.argmax())
        within = np.cumsum(e["size"][skip:], dtype=np.int64) <= budget
        return skip, max(1, int(np.count_nonzero(within)))
    skip = k = acc = 0
    for off, size, _ms, _bloom, _r in ENTRY.iter_unpack(entries):
        if not k and off < log_start:
            skip += 1
            continue
        if k and acc + size > budget:
            break
        acc += size
        k += 1
    return skip, k


def read_fast(
    mlog: MessageLog, crc_from: int, entries: bytes, chunks: list[bytes], poff: int, runs: list[list[int]], seq: int
) -> tuple[int, int] | None:
    """``Pulls._read_records`` for many entries (qmq.store.take), checked with numpy, when
    nothing is out of the ordinary; None (``chunks`` as it was) when something is: the caller
    goes one by one."""
    e = np.frombuffer(entries, dtype=ENTRY_DTYPE)
    n = len(e)
    offsets = e["offset"].astype(np.int64)
    sizes = e["size"].astype(np.int64)
    ends = offsets + sizes
    if int(offsets.min()) < mlog.start or int(sizes.min()) < RECORD_HEADER_BYTES or int(ends.max()) > mlog.end:
        return None
    breaks = np.flatnonzero(offsets[1:] != ends[:-1]) + 1
    first_chunk = len(chunks)
    seqs = np.arange(seq, seq + n, dtype=np.uint64)
    bounds = [0, *breaks.tolist(), n]
    for a, b in itertools.pairwise(bounds):
        start = int(offsets[a])
        mlog.read_into(start, int(ends[b - 1]) - start, chunks)
        chunk = chunks[-1]
        rel = offsets[a:b] - start
        if len(chunk) != int(ends[b - 1]) - start:  # split over two segments: one by one
            del chunks[first_chunk:]
            return None
        heads = np.frombuffer(chunk, dtype=np.uint8)[rel[:, None] + _HEADER_SPAN].view(RECORD_HEADER_DTYPE)[:, 0]
        ok = (
            (heads["magic"] == RECORD_MAGIC)
            & (heads["length"].astype(np.int64) + RECORD_HEADER_BYTES == sizes[a:b])
            & (heads["sequence"] == seqs[a:b])
            & (heads["stored_ms"] == e["stored_ms"][a:b])
        )
        if not ok.all():
            del chunks[first_chunk:]
            return None
        if start < crc_from:  # before what recovery checked: the CRCs too
            view = memoryview(chunk)
            crc32 = crc32c.crc32c
            crcs = heads["crc"].tolist()
            for j, (r, size) in enumerate(zip(rel.tolist(), sizes[a:b].tolist(), strict=True)):
                if crc32(view[r + 8 : r + size]) != crcs[j]:
                    del chunks[first_chunk:]
                    return None
    if runs and runs[-1][0] + runs[-1][1] == poff:
        runs[-1][1] += n
    else:
        runs.append([poff, n])
    return n, int(sizes.sum())


def without(
    chunks: list[bytes], first: int, listed: list[tuple[int, int, int, int, bool]], bad: set[int]
) -> list[bytes]:
    """The records of ``chunks`` (read for ``listed``, whose chunk numbers count from
    ``first``) less those of ``bad``."""
    out: list[bytes] = []
    ci = -1
    p = 0
    started = -1
    for i, size, _ms, at, _crc in listed:
        if at != started:
            started, ci, p = at, at - first, 0
        elif p >= len(chunks[ci]) and ci + 1 < len(chunks):
            ci, p = ci + 1, 0
        if i not in bad:
            out.append(bytes(memoryview(chunks[ci])[p : p + size]))
        p += size
    return out
