"""Messages the broker puts back on a group's retry subject itself: the unacked messages of a
consumer gone silent, and dead letters an operator resends.

A consumer silent for ``consumer_offline_ms`` with unacknowledged messages loses them: each
goes to ``%RETRY%<subject>%<group>`` with its attempt count raised (or, past the group's
``max_retries``, to ``%DEAD_RETRY%<subject>%<group>``), and is acknowledged for that consumer,
so it never receives them again when it comes back. Broadcast groups (``group%consumer``)
are never retried.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

from qmq.common.naming import RETRY_PREFIX, dead_subject, parse_internal_subject, retry_subject
from qmq.protocol.message import HEADER, TIMES_MAX, delivery_attempt, scan_batch, with_times
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.store.consume_log import ENTRY
from qmq.store.intake import Appending

if TYPE_CHECKING:
    from qmq.store.dead_letters import DeadLetters
    from qmq.store.message_log import MessageLog
    from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
    from qmq.store.subjects import SubjectState

log = logging.getLogger(__name__)

_MOVE_BATCH_MAX = 1000
DEFAULT_MAX_RETRIES = 16


class Redelivering(Appending, Protocol):
    """What putting messages back on a retry subject needs of the store."""

    mlog: MessageLog
    dead: DeadLetters

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


def _unacked(cp: ConsumerProgress, limit: int) -> list[tuple[int, int]]:
    """(pull offset, seq) of up to ``limit`` unacked entries of a consumer's pull log."""
    out: list[tuple[int, int]] = []
    acked = cp.acked
    ai = 0
    for poff, seq, count in cp.runs:
        for p in range(max(poff, cp.ack_offset), poff + count):
            while ai < len(acked) and acked[ai][1] <= p:
                ai += 1
            if ai < len(acked) and acked[ai][0] <= p:
                continue
            out.append((p, seq + p - poff))
            if len(out) >= limit:
                return out
    return out


def move_to_retry(store: Redelivering, gp: GroupProgress, cp: ConsumerProgress, max_retries: int) -> int:
    """Move (up to a batch of) ``cp``'s unacked messages to retry; returns how many moved."""
    st = store.subjects.get(gp.subject)
    if st is None:
        return 0
    entries = _unacked(cp, _MOVE_BATCH_MAX)
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
        off, size, *_rest = ENTRY.unpack(raw)
        if off < store.mlog.start:
            continue  # removed by retention: nothing left to retry
        chunk: list[bytes] = []
        store.mlog.read_into(off, size, chunk)
        record = b"".join(chunk)
        header = read_record_header(record, 0)
        assert header is not None
        message = record[RECORD_HEADER_BYTES : RECORD_HEADER_BYTES + header.length]
        attempt = delivery_attempt(HEADER.unpack_from(message, 0)[8])  # the one that timed out
        if attempt > max_retries or attempt >= TIMES_MAX:
            messages.append(with_times(message, attempt, subject=dead_raw))
        else:
            messages.append(with_times(message, attempt + 1, subject=retry_raw))
    if messages:
        body = b"".join(messages)
        result = store.append(body, scan_batch(body))
        if result.errors:
            log.error("moving unacked messages of %r to retry: %s", cp.consumer_id, result.errors[:3])
    store.ack(gp, cp, done)
    return len(entries)


def expire_silent_consumers(store: Redelivering, now_ms: int, offline_ms: int) -> int:
    """Move the unacked messages of every consumer silent for ``offline_ms`` to retry."""
    moved = 0
    for gp in list(store.progress.groups.values()):
        if "%" in gp.group:
            continue
        for cp in list(gp.consumers.values()):
            if now_ms - cp.last_seen_ms >= offline_ms and cp.unacked > 0:
                n = move_to_retry(store, gp, cp, gp.max_retries)
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
