"""Recovery: bring a broker's store back to a consistent state after any stop.

1. Read the checkpoint (offsets, subjects, consumer progress).
2. Scan the message log from the checkpoint (or, for the duplicate window, from the oldest
   checkpoint mark still inside the window), checking every CRC: records after the checkpoint
   are indexed into their consume logs again if their entries were lost, held records (and
   those the checkpoint names) are held again unless a copy follows them (held.py); the
   first record that does not check out marks a torn tail, which is cut and logged.
3. Cut consume-log entries that point past the end of the message log.
4. Replay the action log from the checkpoint into consumer progress (cutting its torn tail).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from qmq.store import action_log as act
from qmq.store.checkpoint import read_checkpoint
from qmq.store.consume_log import ENTRY, ConsumeLog
from qmq.store.held import restore_held
from qmq.store.indexer import RecordIndexer, UnreadableRecord
from qmq.store.message_log import ScanResult
from qmq.store.progress import Progress

if TYPE_CHECKING:
    from qmq.store.broker_store import BrokerStore, SubjectState

log = logging.getLogger(__name__)

_INDEX_FLUSH_ENTRIES = 4096
_DEDUP_CHUNK = 8192


@dataclass(slots=True)
class RecoveryReport:
    from_checkpoint: bool
    records_scanned: int
    entries_rebuilt: int
    torn_bytes: int
    torn_offset: int
    action_torn_bytes: int
    actions_replayed: int
    subjects: int
    groups: int
    seconds: float


def recover(store: BrokerStore) -> RecoveryReport:
    t0 = time.monotonic()
    state = read_checkpoint(store.dir)
    mlog = store.mlog
    if state is not None:
        store.progress = Progress.from_snapshot(state["progress"])
        store.total_messages = int(state["total_messages"])
        store.marks = [list(m) for m in state["marks"]]
        index_from = int(state["message_offset"])
        action_from = int(state["action_offset"])
        known_seqs: dict[str, int] = dict(state["subjects"])
        restore_held(store, state.get("held", []))
    else:
        index_from, action_from, known_seqs = mlog.start, 0, {}

    for directory in sorted(store.consume_dir.iterdir()):
        name = ConsumeLog.subject_in(directory)
        if name is None:
            log.warning("consume log directory %s has no subject file; ignoring it", directory)
            continue
        store.subject_state(name)

    dedup_from = index_from
    cfg = store.config
    for mark in store.marks:
        if store.total_messages - mark[2] <= cfg.dedup_entries_max:
            dedup_from = min(dedup_from, mark[1])
            break
    if not store.dedup.enabled:
        dedup_from = index_from
    scan_from = max(mlog.start, min(index_from, dedup_from))

    scanned = 0
    indexer = RecordIndexer(store, index_from)
    result: list[ScanResult] = []
    for rec in mlog.scan(scan_from, result):
        scanned += 1
        try:
            indexer.add(rec.offset, rec.sequence, rec.stored_ms, rec.message)
        except UnreadableRecord:
            # CRC-valid but unreadable: written by a different version; stop here like a torn tail
            result.append(ScanResult(rec.offset, mlog.end - rec.offset))
            break
    indexer.finish()
    rebuilt = indexer.rebuilt
    good_end, torn = result[-1] if result else (mlog.end, 0)
    if torn:
        mlog.truncate(good_end)
        log.warning("message log: cut a torn tail of %d bytes at offset %d", torn, good_end)

    for st in store.subjects.values():
        _cut_dangling_entries(st, mlog.end)
        st.next_seq = st.visible_seq = st.clog.next_seq
        if known_seqs.get(st.name, 0) > st.next_seq:
            log.error(
                "subject %r had %d messages at the checkpoint but only %d are on disk after recovery",
                st.name,
                known_seqs[st.name],
                st.next_seq,
            )

    torn_actions: list[int] = []
    replayed = 0
    for action in store.alog.replay(action_from, torn_actions):
        apply_action(store, action)
        replayed += 1
    action_torn = torn_actions[-1] if torn_actions else 0
    if action_torn:
        log.warning("action log: cut a torn tail of %d bytes", action_torn)

    now_ms = store.clock.now_ms()
    for gp in store.progress.groups.values():
        sub = store.subjects.get(gp.subject)
        limit = sub.next_seq if sub else 0
        if gp.pull_offset > limit:
            log.warning(
                "group %r of %r was past the end of the subject; moved back to %d",
                gp.group,
                gp.subject,
                limit,
            )
            gp.pull_offset = limit
        for cp in gp.consumers.values():
            cp.cursor = cp.pull_log_end
            cp.session = None
            cp.last_seen_ms = now_ms  # silence is counted from the restart, not from the epoch

    if not store.marks:
        # the log's start bounds the duplicate window's rebuild until the first checkpoint
        store.marks = [[store.clock.now_ms(), mlog.start, 0]]

    return RecoveryReport(
        state is not None,
        scanned,
        rebuilt,
        torn,
        good_end,
        action_torn,
        replayed,
        len(store.subjects),
        len(store.progress.groups),
        round(time.monotonic() - t0, 3),
    )


def _cut_dangling_entries(st: SubjectState, log_end: int) -> None:
    """Drop consume-log entries whose record lies past the end of the message log."""
    clog = st.clog
    cut = 0
    while clog.next_seq > clog.min_seq:
        back = min(1024, clog.next_seq - clog.min_seq)
        raw = clog.read(clog.next_seq - back, back)
        keep = 0
        for i, (off, size, _ms, _bloom, _r) in enumerate(ENTRY.iter_unpack(raw)):
            if off + size > log_end:
                break
            keep = i + 1
        if keep == back:
            break
        cut += clog.truncate(clog.next_seq - back + keep)
        if keep:
            break
    if cut:
        log.warning("consume log of %r: cut %d entries past the end of the message log", st.name, cut)


def apply_action(store: BrokerStore, action: list[Any]) -> None:
    """Apply one action-log record (replayed after a restart, or received by a slave)."""
    progress = store.progress
    kind = action[0]
    if kind == act.DEAD_REMOVE:
        _k, dead_subject, numbers = action
        store.dead.remove(dead_subject, numbers)
        return
    if kind == act.CREATE_GROUP:
        _k, subject, group, start = action
        progress.create_group(subject, group, start)
        return
    gp = progress.get(str(action[1]), str(action[2]))
    if gp is None:
        log.warning("action log names group %r of %r before creating it; skipped", action[2], action[1])
        return
    if kind == act.PULL:
        _k, _s, _g, consumer_id, pull_offset, runs, new_offset = action
        cp = gp.consumer(str(consumer_id))
        if cp.pull_log_end != pull_offset:
            log.warning(
                "pull log of %r in group %r is out of step (%d vs %d)",
                consumer_id,
                gp.group,
                cp.pull_log_end,
                pull_offset,
            )
        Progress.record_pull(gp, cp, runs, new_offset)
    elif kind == act.ACK:
        _k, _s, _g, consumer_id, ranges = action
        Progress.apply_ack(gp.consumer(str(consumer_id)), ranges)
    elif kind == act.RESET:
        gp.pull_offset = action[3]
    else:
        log.warning("unknown action kind %r in the action log; skipped", kind)
