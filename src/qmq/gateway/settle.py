"""``POST /v1/acks``: acks and nacks of receipts, by any gateway of the cluster, answered once
the broker recorded them.

Each receipt is answered on its own: ``acked``; ``nacked`` (it comes back with ``times`` one
higher after the group's back-off, whichever gateway pulled it: qmq.gateway.nacks; at once only
for a receipt past its deadline or whose message cannot be read back); ``expired``
(its ack timeout passed and it was given back: it comes again); ``settled`` (acked or nacked
before through another gateway: this changed nothing); ``held`` (a nack whose retry copy
could not be stored just then: nack it again). The broker decides between an ack and a
give-back (``qmq.broker.settle``), so ``acked`` means it never comes back, to any consumer.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from typing import Any, Final

from qmq.aio import Consumer
from qmq.client.connection import ConnectionPool
from qmq.client.meta import BrokerGroup, MetaClient
from qmq.common.errors import BrokerError, NoBrokerError, QmqError
from qmq.gateway.errors import ApiError, api_error_of, bad_request
from qmq.gateway.payload import ACK_RECEIPTS_MAX, json_object
from qmq.gateway.receipts import Held, Issued, Receipt, ReceiptCodec
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode

log = logging.getLogger(__name__)

# How long an answer waits for the broker to record the acks; past it, 503 (sending them again is safe).
ACK_RECORD_TIMEOUT_MS: Final = 10_000
# SETTLE requests in flight at once for one HTTP request or one sweep.
_SETTLES_AT_ONCE: Final = 64

Lane = tuple[str, str, str, str]


def _ranges(offsets: list[int]) -> list[list[int]]:
    out: list[list[int]] = []
    for o in sorted(set(offsets)):
        if out and out[-1][1] == o:
            out[-1][1] = o + 1
        else:
            out.append([o, o + 1])
    return out


class Settler:
    """SETTLE requests to the master of a receipt's broker group, one per (broker group, subject,
    group, consumer id) of a batch of receipts."""

    def __init__(self, meta: MetaClient, pool: ConnectionPool) -> None:
        self.meta = meta
        self.pool = pool
        self._at_once = asyncio.Semaphore(_SETTLES_AT_ONCE)
        # broker group -> (its master's address, which connection to it) when holds were first
        # taken there: a new address or a new connection means the holds may be gone (qmq.gateway.holds)
        self.held_at: dict[str, tuple[str, int]] = {}

    async def group(self, name: str) -> BrokerGroup | None:
        """Broker group ``name`` of a receipt; one this gateway has not heard of is asked for
        again (it may have come up since the last refresh: a gateway started beside its brokers)."""
        if name not in self.meta.groups:
            await self.meta.fresh()
        return self.meta.groups.get(name)

    async def request(self, lane: Lane, **ranges: Any) -> dict[str, Any]:
        bg_name, subject, group, consumer_id = lane
        bg = await self.group(bg_name)
        if bg is None:
            raise NoBrokerError(
                f"broker group {bg_name} of a receipt is not available now (the meta server lists "
                f"{', '.join(sorted(self.meta.groups)) or 'none'}); send the acks again shortly"
            )
        header = {"subject": subject, "group": group, "consumer_id": consumer_id, **ranges}
        conn = self.pool.get(bg.address)
        async with self._at_once, asyncio.timeout(ACK_RECORD_TIMEOUT_MS / 1000):
            answer = answer_of(await conn.request(RequestCode.SETTLE, header))
        if "hold" in ranges:
            self.held_at.setdefault(bg_name, (bg.address, conn.incarnations))
        return answer

    async def each_lane(
        self, receipts: list[Receipt], op: str, extra: dict[str, Any] | None = None
    ) -> dict[Lane, dict[str, Any] | BaseException]:
        """One SETTLE per lane of ``receipts`` with their positions as the ``op`` ranges."""
        by_lane: dict[Lane, list[int]] = defaultdict(list)
        for r in receipts:
            by_lane[r.lane].append(r.offset)
        lanes = list(by_lane)
        answers = await asyncio.gather(
            *(self.request(lane, **{op: _ranges(by_lane[lane])}, **(extra or {})) for lane in lanes),
            return_exceptions=True,
        )
        return dict(zip(lanes, answers, strict=True))

    async def hold(self, receipts: list[Receipt], hold_ms: int) -> bool:
        """Ask the broker to give ``receipts`` back after ``hold_ms`` unless settled; whether it took them all."""
        answers = await self.each_lane(receipts, "hold", {"hold_ms": hold_ms})
        ok = True
        for lane, answer in answers.items():
            if isinstance(answer, BaseException):
                log.warning("broker group %s did not take the hold of %s's messages: %s", lane[0], lane[3], answer)
                ok = False
            elif not answer.get("held"):
                ok = False
        return ok

    async def give_back(self, receipts: list[Receipt]) -> dict[Receipt, bool | BaseException]:
        """Give back ``receipts`` at once; per receipt True (given back now), False (settled
        before: acked through some gateway, or given back by the broker), or what failed."""
        answers = await self.each_lane(receipts, "give_back")
        out: dict[Receipt, bool | BaseException] = {}
        for r in receipts:
            answer = answers[r.lane]
            out[r] = answer if isinstance(answer, BaseException) else r.offset not in set(answer.get("settled", ()))
        return out


def _receipt_texts(doc: dict[str, Any], key: str) -> list[str]:
    items = doc.get(key, [])
    if not isinstance(items, list) or not all(isinstance(r, str) for r in items):
        raise bad_request("BODY_INVALID", f"{key} must be a list of receipt strings")
    return items


def _already_status(r: Receipt, issued: Issued, answer: dict[str, Any]) -> str:
    """The status of a receipt the broker had settled before this request."""
    local = issued.outcome(r)
    if local is not None:
        return local  # this gateway settled it: a repeat
    if r.offset in set(answer.get("given_back_before", ())):
        return "expired" if time.time() * 1000 >= r.deadline_ms else "nacked"
    return "settled"  # acked or nacked through another gateway (or given back before the broker restarted)


async def settle(
    settler: Settler,
    codec: ReceiptCodec,
    issued: Issued,
    recorder: AckRecorder,
    raw: bytes,
    consumer: Consumer | None = None,
) -> dict[str, Any]:
    doc = json_object(raw)
    unknown = sorted(set(doc) - {"acks", "nacks"})
    if unknown:
        raise bad_request(
            "BODY_INVALID", f'unknown key(s) {", ".join(unknown)}; send {{"acks": [...], "nacks": [...]}}'
        )
    ack_texts, nack_texts = _receipt_texts(doc, "acks"), _receipt_texts(doc, "nacks")
    if len(ack_texts) + len(nack_texts) > ACK_RECEIPTS_MAX:
        raise ApiError(
            413,
            "BATCH_TOO_LARGE",
            f"{len(ack_texts) + len(nack_texts)} receipts are over the {ACK_RECEIPTS_MAX} of one request",
        )
    acks = [codec.decode(t) for t in ack_texts]  # every receipt checked before any is settled
    nacks = [codec.decode(t) for t in nack_texts]
    results: list[dict[str, str]] = [{"receipt": t, "status": ""} for t in ack_texts + nack_texts]
    failed: QmqError | None = None

    # acks: the broker records each and says which were settled before
    answers = await settler.each_lane(acks, "ack")
    for i, r in enumerate(acks):
        answer = answers[r.lane]
        if isinstance(answer, BaseException):
            failed = _as_qmq_error(answer)
            results[i]["status"] = "unrecorded"
            continue
        issued.take(r)
        if r.offset in set(answer.get("settled", ())):
            results[i]["status"] = _already_status(r, issued, answer)
        else:
            issued.settled(r, "acked")
            results[i]["status"] = "acked"

    # nacks: through the SDK (with the group's back-off) when this gateway holds the message, else
    # given back at once by the broker
    base = len(acks)
    local: list[tuple[int, Receipt, Held]] = []
    foreign: list[tuple[int, Receipt]] = []
    for i, r in enumerate(nacks, base):
        held = issued.take(r)
        if held is not None:
            local.append((i, r, held))
        else:
            foreign.append((i, r))
    outcomes = await asyncio.gather(*(h.message.nack() for _i, _r, h in local), return_exceptions=True)
    for (i, r, held), outcome in zip(local, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            issued.put_back(held, held.ack_timeout_ms)  # never dropped: nack it again, or its deadline gives it back
            results[i]["status"] = "held"
            failed = _as_qmq_error(outcome)
        else:
            issued.settled(r, "nacked")
            results[i]["status"] = "nacked"
    if local:
        await recorder.recorded()
    if foreign and consumer is not None:
        # another gateway's receipts: read back and nacked through the SDK, with the group's back-off
        from qmq.gateway.nacks import nack_with_back_off

        copied = await nack_with_back_off(settler, consumer, [r for _i, r in foreign])
        done = [(i, r) for i, r in foreign if copied[r]]
        foreign = [(i, r) for i, r in foreign if not copied[r]]
        if done:
            answers = await settler.each_lane([r for _i, r in done], "ack")
            for i, r in done:
                answer = answers[r.lane]
                if isinstance(answer, BaseException):
                    failed = _as_qmq_error(answer)
                    results[i]["status"] = "held"  # its retry copy is stored: a nack again only adds a copy
                elif r.offset in set(answer.get("settled", ())):
                    log.warning(
                        "receipt of %r at %d was settled meanwhile: its retry copy is one more", r.subject, r.offset
                    )
                    results[i]["status"] = _already_status(r, issued, answer)
                else:
                    issued.settled(r, "nacked")
                    results[i]["status"] = "nacked"
    if foreign:
        backs = await settler.each_lane([r for _i, r in foreign], "give_back")
        for i, r in foreign:
            answer = backs[r.lane]
            if isinstance(answer, BaseException):
                failed = _as_qmq_error(answer)
                results[i]["status"] = "held"
            elif r.offset in set(answer.get("settled", ())):
                results[i]["status"] = _already_status(r, issued, answer)
            else:
                issued.settled(r, "nacked")
                results[i]["status"] = "nacked"
    if failed is not None and all(x["status"] in ("held", "unrecorded") for x in results):
        raise api_error_of(failed)
    return {"results": results}


def _as_qmq_error(exc: BaseException) -> QmqError:
    if isinstance(exc, QmqError):
        return exc
    if isinstance(exc, TimeoutError):
        return BrokerError(
            0,
            "ACKS_NOT_RECORDED",
            f"the broker did not record the acks within {ACK_RECORD_TIMEOUT_MS} ms; sending them again is safe",
            retriable=True,
        )
    log.error("settling receipts failed: %r", exc)
    err = QmqError(f"settling receipts failed: {exc}")
    err.retriable = True
    return err


class AckRecorder:
    """Waits until the broker recorded the acks the SDK consumers made so far (a local nack acks
    the original once its retry copy is stored), for many requests at once: requests arriving
    while a flush runs share the next one."""

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
