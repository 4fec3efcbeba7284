"""ACK_MANY: one consumer acknowledges many (subject, group) pairs of this broker group in one
request (the SDK's periodic ack flush sends one per broker group rather than an ACK per subject).

The header is ``{consumer_id, acks: [{subject, group, ranges[, broadcast][, leave]}, ...]}``, at
most ACK_MANY_ENTRIES_MAX entries; each gets ``{ack_offset[, unheld]}`` (as ACK's answer) or
``{error}`` in the answer's ``results``, in order, so one refused pair does not fail the others.
``leave`` (a consumer closing an ordered listener) hands its slots to the group's others now.
Answered, like ACK, once the acks are durable and reached the slave.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qmq.protocol.answers import encode_answer
from qmq.protocol.codes import Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.requests import BadRequest, get_bool, get_ranges, get_str
from qmq.store.progress import ConsumerProgress, GroupProgress

if TYPE_CHECKING:
    from qmq.broker.handlers import Handlers

ACK_MANY_ENTRIES_MAX = 10_000
_ID_CHARS_MAX = 200


def ack_many(handlers: Handlers, conn: Responder, frame: Frame) -> None:
    header = frame.header
    consumer_id = get_str(header, "consumer_id", max_chars=_ID_CHARS_MAX)
    entries = header.get("acks")
    if not isinstance(entries, list) or not entries:
        raise BadRequest("'acks' must be a non-empty list of {subject, group, ranges} maps")
    if len(entries) > ACK_MANY_ENTRIES_MAX:
        raise BadRequest(f"'acks' has {len(entries)} entries; at most {ACK_MANY_ENTRIES_MAX} a request")
    results: list[dict[str, object]] = []
    leaving: list[tuple[GroupProgress, ConsumerProgress]] = []
    for entry in entries:
        if not isinstance(entry, dict):
            results.append({"error": f"an 'acks' entry must be a map, got {type(entry).__name__}"})
            continue
        try:
            gp, cp = handlers.group_and_consumer({**entry, "consumer_id": consumer_id}, create=False)
            ranges = get_ranges(entry, "ranges")
            acked = handlers.apply_acks(gp, cp, ranges) if ranges else (cp.ack_offset, 0)
            results.append(acked_answer(*acked))
            if get_bool(entry, "leave") and gp.ordered:
                leaving.append((gp, cp))
        except BadRequest as exc:
            results.append({"error": str(exc)})
    parked = handlers.broker.parked
    for gp, cp in leaving:
        # a consumer closing its ordered listener: its slots go to the others now (docs/ordered.md)
        handlers.store.leave_ordered(gp, cp)
        parked.answer_empty(cp)
        parked.notify_soon(gp.subject)
    code, request_id = frame.code, frame.request_id
    answer = encode_answer({"results": results})

    def replicated(error: str | None) -> None:
        if error is None:
            conn.respond(code, request_id, None, (answer,))
        else:
            conn.respond(code, request_id, {"error": error}, status=Status.BUSY)

    handlers.after_acks(conn, code, request_id, replicated)


def acked_answer(ack_offset: int, unheld: int) -> dict[str, object]:
    """An ack's answer (ACK's, an ACK_MANY entry's): the ack offset after it, and how many of the
    positions it named this broker never handed out to the consumer, when any."""
    return {"ack_offset": ack_offset, "unheld": unheld} if unheld else {"ack_offset": ack_offset}
