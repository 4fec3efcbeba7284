"""A consumer's failure path: a message its handler failed (or could not read) is sent again to
its group's retry subject, due after the back-off for its attempt, or to the group's dead letters
once ``max_retries`` are used up, at once for ``DeadLetterNow`` or an unreadable message."""

from __future__ import annotations

import logging
import time

from qmq.client.message import subject_bytes
from qmq.client.producer import Producer
from qmq.client.received import ReceivedBase
from qmq.client.subscription import Subscription, make_subscription
from qmq.common.errors import ERROR_CHARS_MAX, DeadLetterNow, NeedRetry, QmqError, error_text, printable_text
from qmq.common.naming import DEAD_PREFIX, RETRY_PREFIX, dead_subject, parse_internal_subject, retry_subject
from qmq.protocol.message import TIMES_MAX, PropertyValue, encode_message, encode_properties, with_times

log = logging.getLogger(__name__)

# an unreadable id made readable: each bad byte becomes 4 characters, 63 of them fit in 255 bytes
_READABLE_ID_CHARS_MAX = 63
ERROR_PROPERTY = "qmq.error"  # the failing handler's exception, on retried and dead messages


def is_internal(subject: str) -> bool:
    return subject.startswith((RETRY_PREFIX, DEAD_PREFIX))


def failure_subjects(subject: str, group: str) -> tuple[str, str]:
    """Where a failed message of ``subject`` in ``group`` goes: (retry subject, dead-letter subject)."""
    if not is_internal(subject):
        return retry_subject(subject, group), dead_subject(subject, group)
    kind, original, original_group = parse_internal_subject(subject)
    if kind == "retry":
        return subject, dead_subject(original, original_group)
    return subject, subject  # a dead letter read and failed again stays a dead letter


def readable_copy(m: ReceivedBase, subject: bytes, attempt: int, reason: str) -> bytes:
    """A dead letter for a message that cannot be read: its id made readable, its tags dropped,
    its properties kept when they decode, the reason under ``qmq.error``, the body as it was."""
    props: dict[str, PropertyValue]
    try:
        props = dict(m.properties)
    except QmqError:
        props = {}
    props[ERROR_PROPERTY] = printable_text(reason[:ERROR_CHARS_MAX])
    return encode_message(
        subject,
        m.printable_id[:_READABLE_ID_CHARS_MAX].encode("utf-8"),
        b"",
        0,
        encode_properties(props),
        m.body,
        m.created_ms,
        0,
        attempt,
    )


class Failures:
    """The failure path of one consumer (``Consumer._fail_message``)."""

    def __init__(self, max_retries: int) -> None:
        self.max_retries = max_retries  # the consumer's default, for a message of no subscription
        self._warned_no_delay = False

    async def fail(self, producer: Producer, m: ReceivedBase, exc: BaseException | None) -> None:
        """Re-send ``m`` to its retry subject, due after the back-off for its attempt (or to the
        dead letters once its group's ``max_retries`` are used up, or at once when it cannot be
        read), then ack it."""
        tracker = m._tracker
        sub: Subscription = tracker.subscription or make_subscription(max_retries=self.max_retries)
        if sub.broadcast:
            log.warning("broadcast message %s failed (%r); broadcast messages are not retried", m.printable_id, exc)
            tracker.ack(m._offset)
            return
        subject, group = tracker.origin_subject, tracker.group
        attempt = min(m.times, TIMES_MAX)
        retry, dead = failure_subjects(subject, group)
        problem = m.unreadable()
        give_up = isinstance(exc, DeadLetterNow) or attempt > sub.max_retries or attempt >= TIMES_MAX
        target = dead if give_up or problem is not None else retry
        copy_times = attempt if target == dead else attempt + 1  # the attempt the copy is delivered as
        delay_ms = 0
        if target != dead:
            after = exc.after_ms if isinstance(exc, NeedRetry) else None
            delay_ms = sub.backoff_ms(attempt) if after is None else after
        target_raw = subject_bytes(target)
        if problem is not None:
            encoded = readable_copy(m, target_raw, attempt, f"unreadable message: {problem}")
            message_id = m.printable_id
        else:
            props = dict(m.properties)
            if exc is not None:
                props[ERROR_PROPERTY] = error_text(exc)
            props_raw = encode_properties(props)
            due_ms = time.time_ns() // 1_000_000 + delay_ms if delay_ms else 0
            encoded = with_times(m.encoded, copy_times, subject=target_raw, deliver_at_ms=due_ms, properties=props_raw)
            message_id = m.message_id
        try:
            await producer.send_encoded(target, encoded, message_id)
        except QmqError as exc_send:
            if not delay_ms:
                raise
            # Back-off needs a delay server; without one the retry is delivered at once.
            if not self._warned_no_delay:
                self._warned_no_delay = True
                log.warning(
                    "retrying message %s after %d ms failed (%s); retried at once instead (no delay server?)",
                    message_id,
                    delay_ms,
                    exc_send,
                )
            encoded = with_times(encoded, copy_times, deliver_at_ms=0)
            # a resend: the delay server may have kept the copy (no answer, or "outcome unknown")
            # and will hand it over to the group its id picks, whose duplicate window drops one
            await producer.send_encoded(target, encoded, message_id, resend=True)
        if target == dead and dead != retry:
            log.warning(
                "message %s of %r failed %d time(s) in group %s; sent to %s (last error: %s)",
                message_id,
                subject,
                attempt,
                group,
                target,
                problem or (error_text(exc) if exc is not None else None),
            )
        tracker.ack(m._offset)
