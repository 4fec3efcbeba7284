"""Taking the group's next messages for a pull: the range after the group's pull offset,
or, for a group subscribed with tags, the matching messages in it.

Entries whose records retention removed are skipped (never handed out). A filtered take
scans at most ``_SCAN_ENTRIES_MAX`` entries per pull, so a subject full of other tags costs
bounded work; the group's pull offset moves past what was scanned either way.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
