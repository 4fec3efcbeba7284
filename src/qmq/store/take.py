"""Taking the group's next messages for a pull: the range after the group's pull offset,
or, for a group subscribed with tags, the matching messages in it; and reading a subject by
sequence outside any group (READ, for data jobs).

Entries whose records retention removed are skipped (never handed out). A filtered take
scans at most ``_SCAN_ENTRIES_MAX`` entries per pull, so a subject full of other tags costs
bounded work; the group's pull offset moves past what was scanned either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from qmq.store.consume_log import ENTRY, ENTRY_BYTES

if TYPE_CHECKING:
    from qmq.store.broker_store import BrokerStore, PullResult, SubjectState
    from qmq.store.progress import ConsumerProgress, GroupProgress
    from qmq.store.tags import TagFilter

_SCAN_ENTRIES_MAX = 20_000
_SCAN_CHUNK_ENTRIES = 2048


def _start(store: BrokerStore, gp: GroupProgress, st: SubjectState) -> int:
    return max(gp.pull_offset, st.clog.min_seq)


def take_next(
    store: BrokerStore,
    gp: GroupProgress,
    cp: ConsumerProgress,
    st: SubjectState,
    left: int,
    budget: int,
    out: PullResult,
) -> PullResult:
    start = _start(store, gp, st)
    take = min(left, st.visible_seq - start)
    if take <= 0:
        return out
    entries = st.clog.read(start, take)
    log_start = store.mlog.start
    skip = 0
    for off, _size, _ms, _bloom, _r in ENTRY.iter_unpack(entries):
        if off >= log_start:
            break
        skip += 1
    k = 0
    acc = 0
    for _off, size, _ms, _bloom, _r in ENTRY.iter_unpack(entries[skip * ENTRY_BYTES :]):
        if k and acc + size > budget:
            break
        acc += size
        k += 1
    first = start + skip
    if not k:
        if skip:
            store.record_pull(gp, cp, [], first)
        return out
    poff = store.record_pull(gp, cp, [[first, k]], first + k)
    got, size = store.read_records(
        entries[skip * ENTRY_BYTES : (skip + k) * ENTRY_BYTES], out.chunks, cp, poff, out.runs
    )
    return out._replace(messages=out.messages + got, nbytes=out.nbytes + size)


def take_matching(
    store: BrokerStore,
    gp: GroupProgress,
    cp: ConsumerProgress,
    st: SubjectState,
    left: int,
    budget: int,
    tag_filter: TagFilter,
    out: PullResult,
) -> PullResult:
    """Scan from the group's pull offset for messages ``tag_filter`` matches."""
    seq = _start(store, gp, st)
    end = min(st.visible_seq, seq + _SCAN_ENTRIES_MAX)
    log_start = store.mlog.start
    matched: list[tuple[int, bytes]] = []  # (seq, record)
    nbytes = 0
    while seq < end and len(matched) < left and nbytes < budget:
        n = min(_SCAN_CHUNK_ENTRIES, end - seq)
        entries = st.clog.read(seq, n)
        for i, (off, size, _ms, bloom, _r) in enumerate(ENTRY.iter_unpack(entries)):
            if len(matched) >= left or (matched and nbytes + size > budget):
                seq += i
                break
            if off < log_start or not tag_filter.maybe(bloom):
                continue
            chunk: list[bytes] = []
            store.read_into(off, size, chunk)
            record = chunk[0] if len(chunk) == 1 else b"".join(chunk)
            if tag_filter.matches_record(record):
                matched.append((seq + i, record))
                nbytes += size
        else:
            seq += n
            continue
        break
    if seq == _start(store, gp, st):
        return out
    runs: list[list[int]] = []
    for s, _record in matched:
        if runs and runs[-1][0] + runs[-1][1] == s:
            runs[-1][1] += 1
        else:
            runs.append([s, 1])
    poff = store.record_pull(gp, cp, runs, seq)
    if matched:
        out.runs.append([poff, len(matched)])
        out.chunks.extend(record for _s, record in matched)
    return out._replace(messages=out.messages + len(matched), nbytes=out.nbytes + nbytes)


# a consume-log entry (consume_log.ENTRY) as a numpy record, for reading many at once
_ENTRY_DTYPE = np.dtype(
    {
        "names": ["offset", "size", "stored_ms", "bloom"],
        "formats": ["<u8", "<u4", "<i8", "<u8"],
        "offsets": [0, 8, 12, 20],
        "itemsize": 32,
    }
)


def read_range(store: BrokerStore, subject: str, from_seq: int, max_n: int) -> tuple[int, int, list[bytes]]:
    """Up to ``max_n`` visible records of ``subject`` from sequence ``from_seq`` (or the first
    one kept, if retention removed it), outside any consumer group: ``(first, count, chunks)``.

    The entries are read as one numpy array: skipping removed records, the byte budget and
    the runs of adjacent records (one read each) are found without a Python loop per record.
    """
    st = store.subjects.get(subject)
    if st is None:
        return from_seq, 0, []
    first = max(from_seq, st.clog.min_seq)
    raw = st.clog.read(first, max(0, min(max_n, st.visible_seq - first)))
    entries = np.frombuffer(raw, dtype=_ENTRY_DTYPE)
    kept = np.flatnonzero(entries["offset"] >= store.mlog.start)
    if not len(kept):
        return first + len(entries), 0, []
    entries = entries[kept[0] :]
    skip = int(kept[0])
    sizes = entries["size"].astype(np.int64)
    within = np.cumsum(sizes) <= store.limits.pull_bytes_max
    count = max(1, int(np.count_nonzero(within)))
    offsets = entries["offset"][:count].astype(np.int64)
    sizes = sizes[:count]
    breaks = np.flatnonzero(offsets[1:] != offsets[:-1] + sizes[:-1]) + 1
    chunks: list[bytes] = []
    for run in np.split(np.arange(count), breaks):
        start_off = int(offsets[run[0]])
        store.read_into(start_off, int(offsets[run[-1]] + sizes[run[-1]]) - start_off, chunks)
    return first + skip, count, chunks
