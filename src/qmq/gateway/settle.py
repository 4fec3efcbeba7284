"""``POST /v1/acks``: acks and nacks of receipts, answered once the broker recorded them.

Each receipt is answered on its own: ``acked``, ``nacked`` (sent to retry with its group's
back-off), ``expired`` (its ack timeout passed: it was given back to its group and comes
again) or ``unknown`` (not handed out by this gateway, or long forgotten). An ack repeated
(its first answer lost) is answered ``acked`` again.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Final

from qmq.aio import Consumer
from qmq.common.errors import QmqError
from qmq.gateway.errors import ApiError, api_error_of, bad_request
from qmq.gateway.payload import ACK_RECEIPTS_MAX, json_object
from qmq.gateway.receipts import Receipts

log = logging.getLogger(__name__)

# How long an answer waits for the broker to record the acks; past it, 503 (the acks stay
# pending in the SDK and go with its next flush; the client may send them again).
ACK_RECORD_TIMEOUT_MS: Final = 10_000


def _receipts(doc: dict[str, Any], key: str) -> list[str]:
    items = doc.get(key, [])
    if not isinstance(items, list) or not all(isinstance(r, str) for r in items):
        raise bad_request("BODY_INVALID", f"{key} must be a list of receipt strings")
    return items


async def settle(recorder: AckRecorder, receipts: Receipts, raw: bytes) -> dict[str, Any]:
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
        if isinstance(outcome, BaseException):
            # held again (never dropped: the broker would keep it unacknowledged); nack it again later,
            # or its ack timeout gives it back
            receipts.put_back(receipt, held, held.ack_timeout_ms)
            results[i]["status"] = "held"
            if not isinstance(outcome, QmqError):
                log.error("nack of %s failed: %r", held.message.printable_id, outcome)
                outcome = QmqError(f"the retry copy could not be stored: {outcome}")
                outcome.retriable = True
            failed = outcome
        else:
            receipts.settled(receipt, "nacked")
            results[i]["status"] = "nacked"
    await recorder.recorded()
    if failed is not None and all(r["status"] == "held" for r in results):
        raise api_error_of(failed)
    return {"results": results}


class AckRecorder:
    """Waits until the broker recorded the acks made so far, for many requests at once.

    A request's acks are made (``m.ack()``) before it calls ``recorded``; it is answered by the
    first flush that starts after that call and delivers everything it took. Requests arriving
    while a flush runs share the next one, so concurrent ack requests cost one round trip per
    broker group between them, not one each.
    """

    def __init__(self, consumers: list[Consumer]) -> None:
        self.consumers = consumers
        self._next: asyncio.Future[None] | None = None
        self._task: asyncio.Task[None] | None = None

    async def recorded(self) -> None:
        if self._next is None:
            self._next = asyncio.get_running_loop().create_future()
        waiter = self._next
        if self._task is None:
            self._task = asyncio.create_task(self._rounds(), name="ack-rounds")
        await asyncio.shield(waiter)

    async def _rounds(self) -> None:
        try:
            while self._next is not None:
                waiter, self._next = self._next, None
                try:
                    await self._round()
                except BaseException as exc:
                    if not waiter.done():
                        waiter.set_exception(exc)
                    if isinstance(exc, asyncio.CancelledError):
                        raise
                else:
                    if not waiter.done():
                        waiter.set_result(None)
        finally:
            self._task = None

    async def _round(self) -> None:
        try:
            async with asyncio.timeout(ACK_RECORD_TIMEOUT_MS / 1000):
                while True:
                    await asyncio.gather(*(c.flush_acks() for c in self.consumers))
                    if not any(c.acks_undelivered for c in self.consumers):
                        return
                    await asyncio.sleep(0.05)  # a broker away: the next flush tries again, within the deadline
        except TimeoutError:
            raise ApiError(
                503,
                "ACKS_NOT_RECORDED",
                f"the broker did not record the acks within {ACK_RECORD_TIMEOUT_MS} ms; the gateway sends them "
                "again, and sending them again is safe",
            ) from None
