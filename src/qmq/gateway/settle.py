"""``POST /v1/acks``: acks and nacks of receipts, answered once the broker recorded them.

Each receipt is answered on its own: ``acked``, ``nacked`` (sent to retry with its group's
back-off), ``expired`` (its ack timeout passed: it was given back to its group and comes
again) or ``unknown`` (not handed out by this gateway, or long forgotten). An ack repeated
(its first answer lost) is answered ``acked`` again.
"""

from __future__ import annotations

import asyncio
from typing import Any, Final

from qmq.aio import Consumer
from qmq.common.errors import QmqError
from qmq.gateway.errors import ApiError, api_error_of, bad_request
from qmq.gateway.payload import ACK_RECEIPTS_MAX, json_object
from qmq.gateway.receipts import Receipts

# How long an answer waits for the broker to record the acks; past it, 503 (the acks stay
# pending in the SDK and go with its next flush; the client may send them again).
ACK_RECORD_TIMEOUT_MS: Final = 10_000


def _receipts(doc: dict[str, Any], key: str) -> list[str]:
    items = doc.get(key, [])
    if not isinstance(items, list) or not all(isinstance(r, str) for r in items):
        raise bad_request("BODY_INVALID", f"{key} must be a list of receipt strings")
    return items


async def settle(consumer: Consumer, receipts: Receipts, raw: bytes) -> dict[str, Any]:
    doc = json_object(raw)
    unknown = sorted(set(doc) - {"acks", "nacks"})
    if unknown:
        raise bad_request(
            "BODY_INVALID", f'unknown key(s) {", ".join(unknown)}; send {{"acks": [...], "nacks": [...]}}'
        )
    acks, nacks = _receipts(doc, "acks"), _receipts(doc, "nacks")
    if len(acks) + len(nacks) > ACK_RECEIPTS_MAX:
        raise ApiError(
            413, "BATCH_TOO_LARGE", f"{len(acks) + len(nacks)} receipts are over the {ACK_RECEIPTS_MAX} of one request"
        )
    results: list[dict[str, str]] = []
    for receipt in acks:
        held = receipts.take(receipt)
        if held is not None:
            held.message.ack()
            receipts.settled(receipt, "acked")
            status = "acked"
        else:
            status = receipts.outcome(receipt) or "unknown"
        results.append({"receipt": receipt, "status": status})
    nacked = [(i, r, h) for i, r in enumerate(nacks, len(results)) if (h := receipts.take(r)) is not None]
    results += [{"receipt": r, "status": receipts.outcome(r) or "unknown"} for r in nacks]
    outcomes = await asyncio.gather(*(h.message.nack() for _i, _r, h in nacked), return_exceptions=True)
    failed: QmqError | None = None
    for (i, receipt, held), outcome in zip(nacked, outcomes, strict=True):
        if isinstance(outcome, QmqError):
            receipts.put_back(receipt, held, held.ack_timeout_ms)  # held again; nack it again later
            failed = outcome
            results[i]["status"] = "held"
        elif isinstance(outcome, BaseException):
            raise outcome
        else:
            receipts.settled(receipt, "nacked")
            results[i]["status"] = "nacked"
    await _recorded(consumer)
    if failed is not None and all(r["status"] == "held" for r in results):
        raise api_error_of(failed)
    return {"results": results}


async def _recorded(consumer: Consumer) -> None:
    """Return once no ack of ``consumer`` waits to reach its broker; 503 when that takes too long."""
    try:
        async with asyncio.timeout(ACK_RECORD_TIMEOUT_MS / 1000):
            while True:
                await consumer.flush_acks()
                if not consumer.acks_pending:
                    return
                await asyncio.sleep(0.05)  # a broker away: the next flush tries again, within the deadline
    except TimeoutError:
        raise ApiError(
            503,
            "ACKS_NOT_RECORDED",
            f"the broker did not record the acks within {ACK_RECORD_TIMEOUT_MS} ms; they are sent again by the "
            "gateway, and sending them again is safe",
        ) from None
