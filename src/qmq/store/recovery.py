"""Recovery: build a broker store's in-memory parts again from its files after any stop.

1. Read the checkpoint (offsets, subjects, consumer progress, held messages, dedup marks): the
   newest that checks out, the latest or a kept one. Consumer progress is the checkpoint's plus
   the action log after it, so when no checkpoint checks out and the action log no longer
   begins at 0 (segments before the oldest kept checkpoint are deleted), progress would be
   lost: recovery refuses to start (StoreError naming the damaged file) unless the operator
   accepts that (``accept_progress_loss``), never resetting consumer groups without a word.
2. Read the ids of the records between the oldest checkpoint mark still inside the duplicate
   window and the checkpoint, in a pass that reads nothing else (their CRCs are checked when
   they are pulled). Then scan the message log from the checkpoint, checking every CRC: records after the checkpoint
   are indexed into their consume logs again if their entries were lost, held records (and
   those the checkpoint names) are held again unless a copy follows them (held.py). A record
   that fails its CRC (or is cut short) with a good record after it is damage (a flipped
   byte): it is logged, named by file and offset, and skipped, and the scan goes on from the
   next good record, so nothing stored after the damage is cut; bytes that no good record
   follows are a torn tail, which is cut and logged. A record that passes its CRC but does not
   decode is another version's: recovery refuses to start (StoreError naming the file, offset
   and format version), cutting nothing. A consume log holding fewer entries than the
   checkpoint says (damaged, cut) is rebuilt from the message log's start instead.
3. Cut consume-log entries that point past the end of the message log.
4. Replay the action log from the checkpoint into consumer progress (cutting its torn tail).

The store hands recovery its open files and takes the parts it returns (``StoreParts``);
recovery knows nothing of the store itself.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from qmq.common.clock import Clock
from qmq.common.config import BrokerConfig
from qmq.common.limits import Limits
from qmq.store import message_log
from qmq.store.action_log import ActionLog, ProgressLog
from qmq.store.checkpoint import DamagedCheckpoint, candidates, load_checkpoint
from qmq.store.datadir import StoreError
from qmq.store.dead_letters import DeadLetters
from qmq.store.dedup import DedupWindow
from qmq.store.held import HeldMessages
from qmq.store.indexer import RecordIndexer, UnreadableRecord, add_window_keys
from qmq.store.message_log import Checked, Damage, MessageLog, ScanResult
from qmq.store.progress import Progress
from qmq.store.subjects import Subjects

log = logging.getLogger(__name__)

CONSUME_DIR = "consume"
_DAMAGE_LOGGED_MAX = 20


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
    damaged_bytes: int = 0  # message-log bytes that formed no good record, with good ones after them
    window_records: int = 0  # records before the checkpoint read for their ids alone (the duplicate window)


@dataclass(slots=True)
class StoreParts:
    """The in-memory state of a broker's store, each part behind its own interface."""

    subjects: Subjects
    progress: ProgressLog
    dedup: DedupWindow
    held: HeldMessages
    checked: Checked = field(default_factory=Checked)  # what the recovery scan checked of the message log


def empty_parts(
    directory: Path,
    config: BrokerConfig,
    limits: Limits,
    alog: ActionLog,
    dead: DeadLetters,
    progress: Progress | None = None,
) -> StoreParts:
    """Parts that know nothing yet (what a store holds until it is opened)."""
    return StoreParts(
        Subjects(directory / CONSUME_DIR, config.consume_log_segment_entries, limits, config.open_files_max),
        ProgressLog(alog, Progress() if progress is None else progress, dead.remove),
        DedupWindow(config.dedup_window_ms, config.dedup_entries_max),
        HeldMessages(),
    )


def choose_checkpoint(directory: Path, action_start: int, accept_progress_loss: bool) -> dict[str, Any] | None:
    """The newest checkpoint in ``directory`` that checks out (None when there is none), when
    the action log, which now begins at ``action_start``, covers everything after it.

    Raises StoreError when it does not, unless ``accept_progress_loss``: then the loss is logged.
    """
    damaged: list[tuple[Path, str]] = []
    state = None
    for path in candidates(directory):
        try:
            state = load_checkpoint(path)
        except DamagedCheckpoint as exc:
            damaged.append((path, str(exc)))
            continue
        if state is not None:
            break
    action_from = int(state["action_offset"]) if state is not None else 0
    if action_from >= action_start:
        for path, why in damaged:
            log.error("checkpoint %s is damaged (%s); recovering from an older one or the logs' start", path, why)
        return state
    # the refusal is one line (a start-up failure prints one): the first damaged file, and a count
    if damaged:
        path, why = damaged[0]
        others = f" (and {len(damaged) - 1} kept one(s) are damaged too)" if len(damaged) > 1 else ""
        older = "the newest that checks out is older than the action log" if state else "no older one checks out"
        what = f"checkpoint {path} is damaged ({why}){others} and {older}"
    else:
        what = f"there is no checkpoint in {directory}"
    loss = (
        f"the action log now begins at offset {action_start}, so the consumer progress recorded before it "
        "is gone and consumer groups would go back to where that checkpoint (or their start) left them"
    )
    if not accept_progress_loss:
        raise StoreError(
            f"{what}; {loss}. Restore the checkpoint from a backup, or start the broker with "
            "--accept-progress-loss (accept_progress_loss = true) to accept that"
        )
    log.error("%s; %s: accepted (accept_progress_loss)", what, loss)
    return state


def recover(
    directory: Path,
    config: BrokerConfig,
    clock: Clock,
    limits: Limits,
    mlog: MessageLog,
    alog: ActionLog,
    dead: DeadLetters,
) -> tuple[StoreParts, RecoveryReport]:
    """The parts of the store in ``directory``, whose logs are open; torn tails are cut."""
    t0 = time.monotonic()
    state = choose_checkpoint(directory, alog.segments.start, config.accept_progress_loss)
    parts = empty_parts(
        directory, config, limits, alog, dead, Progress.from_snapshot(state["progress"]) if state else None
    )
    subjects, dedup, held = parts.subjects, parts.dedup, parts.held
    if state is not None:
        dedup.restore(int(state["total_messages"]), state["marks"])
        index_from = int(state["message_offset"])
        action_from = int(state["action_offset"])
        known_seqs: dict[str, int] = dict(state["subjects"])
        held.restore(mlog, state.get("held", []))
        for subject, group in state.get("ordered_groups", []):
            ordered = parts.progress.progress.get(subject, group)
            if ordered is not None:
                ordered.ordered = True
    else:
        index_from, action_from, known_seqs = mlog.start, 0, {}

    for unnamed in subjects.open_all():
        log.warning("consume log directory %s holds no subject file and no segment file; ignoring it", unnamed)

    # A consume log shorter than the checkpoint says was damaged: its entries are rebuilt from
    # the start of the message log (they are derived from it), not given up.
    short = [st.name for st in subjects if st.clog.next_seq < known_seqs.get(st.name, 0)]
    short += [name for name in known_seqs if known_seqs[name] and subjects.get(name) is None]
    reindex_from = mlog.start if short else index_from
    if short:
        log.error("consume log(s) of %s hold fewer entries than the checkpoint says: rebuilt from the message log",
                  ", ".join(repr(n) for n in short[:5]))
    first_indexed = max(mlog.start, min(index_from, reindex_from))
    scan_from = max(mlog.start, min(first_indexed, dedup.rebuild_from(index_from)))
    keys_read = 0
    if scan_from < first_indexed:  # records only the duplicate window needs: their keys alone
        scan_from, keys_read = add_window_keys(mlog, scan_from, first_indexed, dedup)
    scanned = 0
    indexer = RecordIndexer(subjects, dedup, held, dead, index_from, reindex_from)
    result: list[ScanResult] = []
    damaged: list[Damage] = []
    for rec in mlog.scan(scan_from, result, damaged=damaged):
        scanned += 1
        try:
            indexer.add(rec.offset, rec.sequence, rec.stored_ms, rec.message)
        except UnreadableRecord as exc:
            seg = mlog.segments.segment_for(rec.offset)
            raise StoreError(
                f"{seg.path if seg else mlog.segments.directory}: {exc}, though it passes its CRC: this qmq "
                f"reads message-log format version {message_log.FORMAT_VERSION} and another version of qmq wrote "
                "it. Nothing was cut: run the qmq version that wrote it, or move the data directory aside"
            ) from None
    indexer.finish()
    for d in damaged[:_DAMAGE_LOGGED_MAX]:
        seg = mlog.segments.segment_for(d.offset)
        where = f"{seg.path} at byte {d.offset - seg.base + seg.head}" if seg else f"offset {d.offset}"
        log.error(
            "message log: %d damaged bytes at offset %d (%s) form no good record: skipped; the good records "
            "after them are kept (a message stored there is lost unless a slave holds it)",
            d.nbytes,
            d.offset,
            where,
        )
    if len(damaged) > _DAMAGE_LOGGED_MAX:
        log.error("message log: %d more damaged places skipped", len(damaged) - _DAMAGE_LOGGED_MAX)
    parts.checked = Checked(scan_from, damaged)
    good_end, torn = result[-1] if result else (mlog.end, 0)
    if torn:
        mlog.truncate(good_end)
        log.warning("message log: cut a torn tail of %d bytes at offset %d", torn, good_end)

    for st in subjects:
        cut = st.clog.cut_past(mlog.end)
        if cut:
            log.warning("consume log of %r: cut %d entries past the end of the message log", st.name, cut)
        st.next_seq = st.visible_seq = st.clog.next_seq
        if known_seqs.get(st.name, 0) > st.next_seq:
            log.error(
                "subject %r had %d messages at the checkpoint but only %d are on disk after recovery",
                st.name,
                known_seqs[st.name],
                st.next_seq,
            )

    replayed, action_torn = parts.progress.replay(action_from)
    if action_torn:
        log.warning("action log: cut a torn tail of %d bytes", action_torn)

    now_ms = clock.now_ms()
    progress = parts.progress.progress
    for gp in progress.groups.values():
        sub = subjects.get(gp.subject)
        limit = sub.next_seq if sub else 0
        if gp.pull_offset > limit:
            log.warning("group %r of %r was past the end of the subject; moved back to %d", gp.group, gp.subject, limit)
            gp.pull_offset = limit
        for cp in gp.consumers.values():
            if config.flush == "sync":
                cut = Progress.cut_pull_log(cp, limit)
                if cut:
                    log.warning(
                        "pull log of consumer %r of group %r named %d messages of %r past its end (lost with the "
                        "power, their pull never answered): cut",
                        cp.consumer_id,
                        gp.group,
                        cut,
                        gp.subject,
                    )
            cp.cursor = cp.pull_log_end
            cp.session = None
            cp.last_seen_ms = now_ms  # silence is counted from the restart, not from the epoch
    dedup.begin_marks(now_ms, mlog.start)
    if state is not None or scanned or replayed:
        # pulls answered before the stop may be lost (a power loss under periodic): pull logs go on
        # past whatever positions they had (progress.py)
        parts.progress.new_stretch()

    report = RecoveryReport(
        state is not None,
        scanned,
        indexer.rebuilt,
        torn,
        good_end,
        action_torn,
        replayed,
        len(subjects.by_name),
        len(progress.groups),
        round(time.monotonic() - t0, 3),
        sum(d.nbytes for d in damaged),
        keys_read,
    )
    return parts, report
