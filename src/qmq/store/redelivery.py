"""Messages the broker puts back on a group's retry subject itself: the unacked messages of a
consumer gone silent, and dead letters an operator resends.

A consumer silent for ``consumer_offline_ms`` with unacknowledged messages loses them: each
goes to ``%RETRY%<subject>%<group>`` with its attempt count raised (or, past the group's
``max_retries``, to ``%DEAD_RETRY%<subject>%<group>``), and is acknowledged for that consumer,
so it never receives them again when it comes back. Broadcast groups (``group%consumer``)
are never retried.

One bad consumer or message never stops the rest: a message that cannot be put back on retry
(its attempt count already at the largest the codec holds, or unreadable) goes to the dead
letters with the reason (``qmq.error``), or, if it cannot even be that, is skipped; either
way it is logged and counted (``RedeliveryProblems``). A consumer whose messages cannot be
read is logged, counted and tried again on the next round; the other consumers go on.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from qmq.common.naming import RETRY_PREFIX, dead_subject, parse_internal_subject, retry_subject
from qmq.protocol.message import (
    HEADER,
    HEADER_BYTES,
    TIMES_MAX,
    decode_properties,
    delivery_attempt,
    encode_properties,
    scan_batch,
    with_times,
)
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store import clog_repair
from qmq.store.clog_repair import DAMAGED, GOOD, check_record
from qmq.store.consume_log import ENTRY, ENTRY_BYTES
from qmq.store.datadir import StoreError
from qmq.store.dead_letters import ERROR_PROPERTY
from qmq.store.intake import Appending

if TYPE_CHECKING:
    from qmq.store.dead_letters import DeadLetters
    from qmq.store.message_log import MessageLog
    from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
    from qmq.store.subjects import SubjectState

log = logging.getLogger(__name__)

_MOVE_BATCH_MAX = 1000
DEFAULT_MAX_RETRIES = 16


@dataclass(slots=True)
class RedeliveryProblems:
    """What went wrong putting messages back on retry, counted since the store opened."""

    consumers_failed: int = 0  # rounds in which a consumer's messages could not be moved (tried again)
    messages_set_aside: int = 0  # messages that could not be retried: dead-lettered with the reason, or skipped


class Redelivering(Appending, Protocol):
    """What putting messages back on a retry subject needs of the store."""

    mlog: MessageLog
    dead: DeadLetters
    redelivery_problems: RedeliveryProblems

    @property
    def subjects(self) -> Mapping[str, SubjectState]: ...
    @property
    def progress(self) -> Progress: ...

    def ack(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> int: ...
    def remove_dead(self, dead_subject: str, numbers: list[int]) -> None: ...


def base_of(subject: str, group: str) -> tuple[str, str]:
    """The user subject and group behind a subject a group consumes (itself, or a retry subject)."""
    if subject.startswith(RETRY_PREFIX):
        _kind, base, base_group = parse_internal_subject(subject)
        return base, base_group
    return subject, group


def _unacked(cp: ConsumerProgress, limit: int, only: list[list[int]] | None = None) -> list[tuple[int, int]]:
    """(pull offset, seq) of up to ``limit`` unacked entries of a consumer's pull log (only
    those within the sorted, disjoint [start, end) ranges ``only``, when given)."""
    out: list[tuple[int, int]] = []
    acked = cp.acked
    ai = 0
    oi = 0
    for poff, seq, count in cp.runs:
        for p in range(max(poff, cp.ack_offset), poff + count):
            while ai < len(acked) and acked[ai][1] <= p:
                ai += 1
            if ai < len(acked) and acked[ai][0] <= p:
                continue
            if only is not None:
                while oi < len(only) and only[oi][1] <= p:
                    oi += 1
                if oi == len(only):
                    return out
                if only[oi][0] > p:
                    continue
            out.append((p, seq + p - poff))
            if len(out) >= limit:
                return out
    return out


def move_to_retry(
    store: Redelivering,
    gp: GroupProgress,
    cp: ConsumerProgress,
    max_retries: int,
    only: list[list[int]] | None = None,
) -> int:
    """Move (up to a batch of) ``cp``'s unacked messages to retry (only those at the pull-log
    positions of the sorted, disjoint [start, end) ranges ``only``, when given: an HTTP
    gateway's receipts whose ack timeout passed); returns how many moved."""
    st = store.subjects.get(gp.subject)
    if st is None:
        return 0
    entries = _unacked(cp, _MOVE_BATCH_MAX, only)
    if not entries:
        return 0
    subject, group = base_of(gp.subject, gp.group)
    retry_raw = retry_subject(subject, group).encode()
    dead_raw = dead_subject(subject, group).encode()
    messages: list[bytes] = []
    done: list[list[int]] = []
    for poff, seq in entries:
        raw = st.clog.read(seq, 1)
        done.append([poff, poff + 1])
        if len(raw) != ENTRY_BYTES:
            _set_aside(store, None, f"entry {seq} of {gp.subject!r} is not in its consume log", dead_raw)
            continue
        off, _size, _ms, *_rest = ENTRY.unpack(raw)
        if off < store.mlog.start:
            continue  # removed by retention: nothing left to retry
        record = _checked_record(store, st, seq, raw)
        if record is None:
            _set_aside(store, None, f"entry {seq} of {gp.subject!r} names no good record (damaged)", dead_raw)
            continue
        message = record[RECORD_HEADER_BYTES:]
        try:
            attempt = delivery_attempt(HEADER.unpack_from(message, 0)[8])  # the one that timed out
            if attempt > max_retries or attempt >= TIMES_MAX:
                retry = with_times(message, attempt, subject=dead_raw)
            else:
                retry = with_times(message, attempt + 1, subject=retry_raw)
            scan_batch(retry)  # each on its own: one that cannot be stored must not sink the batch
        except Exception as exc:  # whatever is wrong with this one message, it is set aside alone
            letter = _set_aside(store, message, f"{gp.subject!r} sequence {seq} cannot be retried: {exc}", dead_raw)
            if letter is not None:
                messages.append(letter)
            continue
        messages.append(retry)
    if messages:
        body = b"".join(messages)
        result = store.append(body, scan_batch(body))
        if result.errors:
            log.error("moving unacked messages of %r to retry: %s", cp.consumer_id, result.errors[:3])
    store.ack(gp, cp, done)
    return len(entries)


def _checked_record(store: Redelivering, st: SubjectState, seq: int, raw: bytes) -> bytes | None:
    """The record entry ``raw`` (number ``seq`` of ``st``) names, if it checks out against the
    entry and its CRC: a damaged one is never copied into a retry (its copy would pass its
    CRC). An entry that disagrees is repaired from the message log first (clog_repair.py)."""
    for attempt in range(2):
        off, size, ms, *_rest = ENTRY.unpack(raw)
        if size >= RECORD_HEADER_BYTES and off + size <= store.mlog.end:
            chunk: list[bytes] = []
            store.mlog.read_into(off, size, chunk)
            record = b"".join(chunk)
            found = check_record(record, 0, size, seq, ms)
            if found == GOOD:
                return record
            if found == DAMAGED:
                return None
        if attempt == 0:
            clog_repair.repair(st.clog, store.mlog, seq, seq + 1)
            raw = st.clog.read(seq, 1)
    return None


def _set_aside(store: Redelivering, message: bytes | None, reason: str, dead_raw: bytes) -> bytes | None:
    """Count and log a message that cannot be retried; returns it for the dead letters
    (``dead_raw``) with the reason among its properties, or None if it cannot even be that."""
    store.redelivery_problems.messages_set_aside += 1
    letter = None
    if message is not None:
        try:
            fields = HEADER.unpack_from(message, 0)
            props_at = HEADER_BYTES + fields[2] + fields[3] + fields[5]
            try:
                props = decode_properties(message[props_at : props_at + fields[10]])
            except Exception:  # unreadable properties: the reason alone is kept
                props = {}
            props[ERROR_PROPERTY] = reason
            letter = with_times(
                message, min(fields[8], TIMES_MAX), subject=dead_raw, properties=encode_properties(props)
            )
            scan_batch(letter)
        except Exception:  # not even a readable message: nothing to keep
            letter = None
    log.error("%s; %s", reason, "it goes to the dead letters" if letter is not None else "it is skipped")
    return letter


def expire_silent_consumers(store: Redelivering, now_ms: int, offline_ms: int) -> int:
    """Move the unacked messages of every consumer silent for ``offline_ms`` to retry.

    A consumer that fails is logged, counted and tried again next time; a StoreError (the store
    takes no writes now) ends the round, since every other move would fail too.
    """
    moved = 0
    for gp in list(store.progress.groups.values()):
        if "%" in gp.group or gp.ordered:
            continue  # an ordered group's silent consumers lose their slots instead (ordered_take)
        for cp in list(gp.consumers.values()):
            if now_ms - cp.last_seen_ms >= offline_ms and cp.unacked > 0:
                try:
                    n = move_to_retry(store, gp, cp, gp.max_retries)
                except StoreError as exc:
                    log.error("moving unacked messages to retry stopped: %s", exc)
                    return moved
                except Exception:  # one consumer's trouble never stops the others' redelivery
                    store.redelivery_problems.consumers_failed += 1
                    log.exception(
                        "the unacked messages of consumer %r of group %r on %r could not be moved to retry; "
                        "tried again next round",
                        cp.consumer_id,
                        gp.group,
                        gp.subject,
                    )
                    continue
                if n:
                    log.warning(
                        "consumer %r of group %r was silent for %d ms: moved %d unacked message(s) of %r to retry",
                        cp.consumer_id,
                        gp.group,
                        now_ms - cp.last_seen_ms,
                        n,
                        gp.subject,
                    )
                moved += n
    return moved


def resend_dead(store: Redelivering, subject: str, group: str, message_id: str | None) -> int:
    """Put dead letters (one id, or all) back on the group's retry subject, attempts reset."""
    name = dead_subject(subject, group)
    target = retry_subject(subject, group).encode()
    resent = 0
    while True:
        letters = store.dead.letters(name, limit=_MOVE_BATCH_MAX, message_id=message_id)
        if not letters:
            return resent
        body = b"".join(with_times(letter.message, 1, subject=target) for letter in letters)
        store.append(body, scan_batch(body), dedup_check=False)
        store.remove_dead(name, [letter.number for letter in letters])
        resent += len(letters)


def purge_dead(store: Redelivering, subject: str, group: str, message_id: str | None) -> int:
    name = dead_subject(subject, group)
    purged = 0
    while True:
        letters = store.dead.letters(name, limit=_MOVE_BATCH_MAX, message_id=message_id)
        if not letters:
            return purged
        store.remove_dead(name, [letter.number for letter in letters])
        purged += len(letters)
