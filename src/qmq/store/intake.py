"""A send's messages before they are written: which are refused (by index, with a status and
the reason), which repeat a message already stored (the duplicate window), and where each of
the rest goes (its subject, or the dead letters); and what the store answers for a send.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple, Protocol

from qmq.common.errors import InvalidSubjectError
from qmq.common.limits import HOLD_MS_MAX, Limits
from qmq.common.naming import DEAD_PREFIX
from qmq.protocol.codes import Status
from qmq.protocol.message import ScannedMessage
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store.consume_log import tag_bloom
from qmq.store.dedup import DedupWindow, dedup_key
from qmq.store.subjects import Subjects, SubjectState

_DEAD_RAW = DEAD_PREFIX.encode()


class AppendResult(NamedTuple):
    errors: list[list[Any]]  # [index, status, text]
    duplicates: int
    stored: int
    stored_bytes: int
    per_subject: dict[str, list[int]]  # subject -> [messages, bytes]


class Appending(Protocol):
    """A store that takes sends: what the parts that store messages themselves (held
    releases, retries) call back."""

    def append(
        self,
        body: bytes,
        scanned: list[ScannedMessage],
        dedup_check: bool = ...,
        now_ms: int | None = ...,
        visible_now: bool = ...,
    ) -> AppendResult: ...


class Intake(NamedTuple):
    errors: list[list[Any]]  # [index, status, text]
    # (message, its subject or the name of its dead-letter subject, tag bloom, duplicate key)
    accepted: list[tuple[ScannedMessage, SubjectState | str, int, int]]
    duplicates: int
    record_bytes: int  # of the accepted messages' records, headers included


def check_send(
    scanned: list[ScannedMessage],
    now_ms: int,
    limits: Limits,
    subjects: Subjects,
    dedup: DedupWindow,
    dedup_check: bool,
    refused: Mapping[int, str] | None = None,
) -> Intake:
    """Sort a send's messages into refused, repeated and accepted. ``dedup_check=False`` (the
    broker's own resends) accepts a message even if its key is in the duplicate window;
    repeats within the send are dropped either way. ``refused`` names messages the caller
    refuses (INVALID_MESSAGE with the reason), e.g. fields consumers could not decode."""
    errors: list[list[Any]] = []
    accepted: list[tuple[ScannedMessage, SubjectState | str, int, int]] = []
    seen: set[int] = set()
    duplicates = 0
    total = 0
    # where each subject named in the send goes, found once a send (a batch names few subjects)
    targets: dict[bytes, SubjectState | str] = {}
    message_bytes_max = limits.message_bytes_max
    id_chars_max = limits.message_id_chars_max
    due_max = now_ms + HOLD_MS_MAX
    for i, sm in enumerate(scanned):
        if refused and i in refused:
            errors.append([i, Status.INVALID_MESSAGE, f"message {i} of the batch is refused: {refused[i]}"])
            continue
        target = targets.get(sm.subject)
        if target is None:
            try:
                if sm.subject.startswith(_DEAD_RAW):
                    target = subjects.dead_name(sm.subject)
                else:
                    target = subjects.for_raw(sm.subject)
            except InvalidSubjectError as exc:
                errors.append([i, Status.INVALID_SUBJECT, str(exc)])
                continue
            targets[sm.subject] = target
        if sm.length > message_bytes_max or not sm.message_id or len(sm.message_id) > id_chars_max:
            error = _size_or_id_error(i, sm, limits)
            if error is not None:
                errors.append(error)
                continue
        if sm.deliver_at_ms > due_max:
            errors.append(
                [
                    i,
                    Status.INVALID_MESSAGE,
                    f"due {sm.deliver_at_ms - now_ms} ms from now: a broker holds messages due at most "
                    f"{HOLD_MS_MAX} ms ahead; send later ones to a delay server",
                ]
            )
            continue
        bloom = 0
        if sm.tags:
            if _tag_count(sm.tags) > limits.tags_max:
                errors.append([i, Status.INVALID_MESSAGE, f"message has more than tags_max {limits.tags_max} tags"])
                continue
            bloom = tag_bloom(sm.tags)
        key = dedup_key(sm)
        if key in seen or (dedup_check and key in dedup):
            duplicates += 1
            continue
        seen.add(key)
        accepted.append((sm, target, bloom, key))
        total += RECORD_HEADER_BYTES + sm.length
    return Intake(errors, accepted, duplicates, total)


def _size_or_id_error(i: int, sm: ScannedMessage, limits: Limits) -> list[Any] | None:
    if sm.length > limits.message_bytes_max:
        text = f"message of {sm.length} bytes exceeds message_bytes_max {limits.message_bytes_max}"
        return [i, Status.MESSAGE_TOO_LARGE, text]
    if not sm.message_id or len(sm.message_id) > limits.message_id_chars_max:
        return [i, Status.INVALID_MESSAGE, f"message id must be 1..{limits.message_id_chars_max} bytes"]
    return None


def _tag_count(tags_block: bytes) -> int:
    n = 0
    pos = 0
    while pos < len(tags_block):
        pos += 1 + tags_block[pos]
        n += 1
    return n
