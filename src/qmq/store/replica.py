"""Replication at the store level: what a master reads for its slaves, what a slave appends,
and how a demoted master cuts its logs back to where its new master's copy ended.

A slave's message log and action log are byte-for-byte copies of its master's, at the same
offsets and in segments with the same bases: the master sends whole records from one
segment at a time with that segment's base, and the slave begins a new segment exactly where
the master did. What a slave appends is indexed as recovery would index it (consume logs,
duplicate window, dead letters, consumer progress), so on promotion it serves at once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple, Protocol

from qmq.protocol.record import RECORD_HEADER_BYTES, RecordHeader, read_record_header, record_crc_ok
from qmq.store import action_log, fileio, message_log
from qmq.store.checkpoint import NAME as CHECKPOINT_NAME
from qmq.store.checkpoint import history, read_checkpoint
from qmq.store.segments import SegmentedLog

if TYPE_CHECKING:
    from qmq.common.config import BrokerConfig
    from qmq.store.action_log import ActionLog
    from qmq.store.dead_letters import DeadLetters
    from qmq.store.indexer import RecordIndexer
    from qmq.store.message_log import MessageLog
    from qmq.store.recovery import RecoveryReport
    from qmq.store.subjects import SubjectState

log = logging.getLogger(__name__)


class Replicated(Protocol):
    """What replication needs of a store: its logs to read and append, the indexing and
    replay of what it appends, and closing and recovering it to cut its logs back."""

    dir: Path
    config: BrokerConfig
    mlog: MessageLog
    alog: ActionLog
    dead: DeadLetters
    failed: str | None

    @property
    def subjects(self) -> Mapping[str, SubjectState]: ...

    def indexer(self, index_from: int) -> RecordIndexer: ...
    def replay_actions(self, start: int) -> tuple[int, int]: ...
    def close_files(self) -> None: ...
    def reopen(self) -> RecoveryReport: ...


class ReplicaError(Exception):
    """The slave's copy and the master's log do not line up; the text says how."""


class Chunk(NamedTuple):
    offset: int
    segment_base: int
    data: bytes


def _read_whole(
    segs: SegmentedLog, offset: int, max_bytes: int, frame_len: Callable[[bytes, int], int | None]
) -> Chunk:
    if offset > segs.end:
        raise ReplicaError(f"asked for offset {offset}, past the end of the log ({segs.end}): the copies diverged")
    if offset == segs.end:
        return Chunk(offset, segs.active.base if segs.active.base <= offset else offset, b"")
    seg = segs.segment_for(offset)
    if seg is None:
        raise ReplicaError(f"offset {offset} is no longer kept (the log starts at {segs.start}); copy the group anew")
    want = min(max_bytes, seg.end - offset)
    data = segs.read(offset, want)
    cut = 0
    while cut < len(data):
        n = frame_len(data, cut)
        if n is None or cut + n > len(data):
            break
        cut += n
    if cut == 0:  # one frame larger than max_bytes: send it whole
        n = frame_len(segs.read(offset, 64), 0)
        if n is not None:
            data = segs.read(offset, n)
            cut = len(data)
    return Chunk(offset, seg.base, data[:cut])


def _record_len(buf: bytes, pos: int) -> int | None:
    h = read_record_header(buf, pos)
    return None if h is None else RECORD_HEADER_BYTES + h.length


def read_records(segs: SegmentedLog, offset: int, max_bytes: int) -> Chunk:
    """Whole records (``qmq.protocol.record``) of a log of them from ``offset``, from one segment,
    at most about ``max_bytes``: a broker's message log, a delay server's write-ahead log."""
    return _read_whole(segs, offset, max_bytes, _record_len)


def read_log(store: Replicated, offset: int, max_bytes: int) -> Chunk:
    """Whole message-log records from ``offset``, from one segment, at most about ``max_bytes``."""
    return read_records(store.mlog.segments, offset, max_bytes)


def read_actions(store: Replicated, offset: int, max_bytes: int) -> Chunk:
    return _read_whole(store.alog.segments, offset, max_bytes, action_log.frame_len)


def follow_segment(segs: SegmentedLog, offset: int, segment_base: int) -> None:
    """Check that a chunk continues this copy, and begin a segment where the master began one."""
    if offset != segs.end:
        raise ReplicaError(f"a chunk at offset {offset} does not continue this copy, which ends at {segs.end}")
    if segment_base == offset and segs.active.base != offset:
        segs.start_segment(offset)


def append_log(store: Replicated, chunk: Chunk) -> set[str]:
    """Append a master's records and index them; returns the subjects that got messages."""
    _check_writable(store)
    if not chunk.data:
        return set()
    segs = store.mlog.segments
    records = append_records(segs, chunk)
    data = chunk.data
    indexer = store.indexer(chunk.offset)
    view = memoryview(data)
    for offset, h, p in records:
        indexer.add(offset, h.sequence, h.stored_ms, view[p + RECORD_HEADER_BYTES : p + RECORD_HEADER_BYTES + h.length])
    touched = indexer.finish()
    for name in touched:
        st = store.subjects[name]
        st.visible_seq = st.next_seq
    return touched


def append_records(segs: SegmentedLog, chunk: Chunk) -> list[tuple[int, RecordHeader, int]]:
    """Append a master's whole records to a copy of its log of them, each checked first; returns
    each record's (offset, header, position in the chunk)."""
    follow_segment(segs, chunk.offset, chunk.segment_base)
    data = chunk.data
    records = []
    pos = 0
    while pos < len(data):
        h = read_record_header(data, pos)
        if h is None or not record_crc_ok(data, pos, h):
            raise ReplicaError(f"record at offset {chunk.offset + pos} from the master fails its check")
        records.append((chunk.offset + pos, h, pos))
        pos += RECORD_HEADER_BYTES + h.length
    segs.append(data, roll=False)
    return records


def append_actions(store: Replicated, chunk: Chunk) -> int:
    """Append a master's action-log records and apply them; returns how many."""
    _check_writable(store)
    if not chunk.data:
        return 0
    segs = store.alog.segments
    follow_segment(segs, chunk.offset, chunk.segment_base)
    segs.append(chunk.data, roll=False)
    n, torn = store.replay_actions(chunk.offset)
    if torn:
        raise ReplicaError(f"action-log records from the master at offset {chunk.offset} fail their check")
    return n


def _check_writable(store: Replicated) -> None:
    if store.failed is not None:
        raise ReplicaError(
            f"this slave's store stopped taking writes ({store.failed}); restart it to copy its master again"
        )


def rewind(store: Replicated, message_offset: int, action_offset: int) -> RecoveryReport:
    """Cut both logs back to where a new master's copy ended, then recover.

    Recovery starts from the newest kept checkpoint at or before the cut; newer checkpoints
    (they describe writes that are being cut) are deleted, and so are dead letters past it.
    """
    log.warning("cutting the logs back to message offset %d, action offset %d", message_offset, action_offset)
    store.close_files()
    mlog_segs = SegmentedLog(
        store.dir / "log", message_log.SEGMENT_SUFFIX, store.config.segment_bytes, message_log.FILE_KIND
    )
    cut_bytes = mlog_segs.truncate(min(message_offset, mlog_segs.end))
    mlog_segs.close()
    alog_segs = SegmentedLog(
        store.dir / "action", action_log.SEGMENT_SUFFIX, action_log.SEGMENT_BYTES, action_log.FILE_KIND
    )
    alog_segs.truncate(min(action_offset, alog_segs.end))
    alog_segs.close()
    chosen = None
    for path in reversed(history(store.dir)):
        state = read_checkpoint(store.dir, path)
        if state is not None and state["message_offset"] <= message_offset and state["action_offset"] <= action_offset:
            chosen = path
            break
        fileio.unlink(path, missing_ok=True)
    current = store.dir / CHECKPOINT_NAME
    if chosen is not None:
        fileio.copy_file(chosen, current)
    else:
        fileio.unlink(current, missing_ok=True)
    log.warning("cut %d bytes of the message log; recovering from %s", cut_bytes, chosen or "the start of the logs")
    report = store.reopen()
    store.dead.cut_from(message_offset)
    fileio.sync()
    return report
