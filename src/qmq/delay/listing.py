"""DELAY_LIST: one page of the pending delay messages of a subject, by due time.

A message due in the future sits in the bucket of its due time (schedule.py), so the buckets
overlapping ``[from_ms, to_ms)`` are walked in time order, and in each the entries due in the
range that no dispatch log names (neither handed over nor cancelled) are taken in due order
(then entry order) and their records read, one bucket at a time: memory holds one bucket's
index, never the backlog. The loop writes the buckets' buffers (as a checkpoint does) and
notes their sizes (``Listed``); the walk reads only that much, with descriptors of its own,
on the checkpoint thread, so a long one never holds up sends. Records of other subjects are read and skipped, at most
``SCAN_RECORDS_MAX`` a request; a page that stops there, or at its ``limit`` or
``PAGE_BYTES_MAX``, carries ``next``: ``[bucket start, due_ms, entry]`` of the last entry
looked at, which the next request passes back as ``after``. A message already due when it
arrived joins the current bucket and is handed over at once: it may be missed.

Each item: ``{"message_id", "due_ms", "copy", "times", "created_ms", "tags", "bytes"}``
(``copy``: of a repeating message, 0 otherwise; ``bytes``: of the encoded message).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from qmq.delay import dispatch_log
from qmq.delay.bucket import DISPATCH, MESSAGES, Bucket, read_index
from qmq.protocol.answers import Page
from qmq.protocol.message import HEADER, HEADER_BYTES, decode_tags
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store import fileio

# records read per request, matching or not: about 50 ms of reads and checks
SCAN_RECORDS_MAX = 20_000
LIST_ITEMS_MAX = 10_000
# enough of a record for its header, subject, id and tags (subject 512 bytes, id 255, tags 10 × 256)
_HEAD_READ_BYTES = RECORD_HEADER_BYTES + HEADER_BYTES + 4096

Cursor = list[int]  # [bucket start, due_ms, entry]


class Listed(NamedTuple):
    """A bucket as the listing reads it: where it is and the entries it had written."""

    start_ms: int
    directory: Path
    entries: int


def buckets_to_list(buckets: list[Bucket], bucket_ms: int, from_ms: int, to_ms: int) -> list[Listed]:
    """The buckets overlapping ``[from_ms, to_ms)`` as written now (on the loop, once their
    buffers are written: ``Schedule.flush_buffers``)."""
    out = []
    for b in buckets:
        if b.start_ms + bucket_ms <= from_ms:
            continue
        if b.start_ms >= to_ms:
            break
        out.append(Listed(b.start_ms, b.directory, b.flushed_count))
    return out


def list_pending(
    buckets: list[Listed], subject: bytes, from_ms: int, to_ms: int, limit: int, after: Cursor | None
) -> tuple[Page, Cursor | None]:
    """One page of pending messages of ``subject`` due in ``[from_ms, to_ms)`` after ``after``
    (files only, own descriptors: runs on a worker thread)."""
    page = Page(limit)
    scanned = 0
    last: Cursor | None = None
    for b in buckets:
        if after is not None and b.start_ms < after[0]:
            continue
        try:
            index = read_index(b.directory, b.entries)
            done = dispatch_log.read(b.directory / DISPATCH).entries  # damage: logged when loaded
            fd = fileio.open(b.directory / MESSAGES, os.O_RDONLY) if b.entries else -1
        except FileNotFoundError:
            continue  # deleted meanwhile: it held nothing pending
        try:
            dues = index["due"]
            entries = np.arange(len(index), dtype=np.int64)
            keep = (dues >= from_ms) & (dues < to_ms)
            if after is not None and b.start_ms == after[0]:
                keep &= (dues > after[1]) | ((dues == after[1]) & (entries > after[2]))
            if len(done):
                keep[done[done < len(index)]] = False
            picked = entries[keep]
            picked = picked[np.lexsort((picked, dues[picked]))]
            for entry in picked.tolist():
                if scanned >= SCAN_RECORDS_MAX or not page.has_room():
                    return page, last
                scanned += 1
                offset, size, due = int(index["offset"][entry]), int(index["size"][entry]), int(dues[entry])
                item = _item(fileio.pread(fd, min(size, _HEAD_READ_BYTES), offset), size, subject, due)
                if item is not None and not page.add(item):
                    return page, last
                last = [b.start_ms, due, entry]
        finally:
            if fd >= 0:
                fileio.close(fd)
    return page, None


def _item(head: bytes, size: int, subject: bytes, due_ms: int) -> dict[str, Any] | None:
    m = RECORD_HEADER_BYTES
    if len(head) < m + HEADER_BYTES:
        return None
    _v, _f, slen, ilen, _tc, tlen, created, _due, times, copy, _pl, _bl = HEADER.unpack_from(head, m)
    s = m + HEADER_BYTES
    if head[s : s + slen] != subject:
        return None
    i = s + slen
    try:
        tags = decode_tags(head[i + ilen : i + ilen + tlen]) if tlen else []
    except Exception:  # a damaged record: listed without its tags, skipped when due
        tags = []
    return {
        "message_id": head[i : i + ilen].decode("utf-8", "replace"),
        "due_ms": due_ms,
        "copy": copy,
        "times": times,
        "created_ms": created,
        "tags": tags,
        "bytes": size - RECORD_HEADER_BYTES,
    }
