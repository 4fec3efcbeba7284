"""Receipts: what a pulled message is handed out under, and what any gateway of the cluster
settles it by.

A receipt names, under a MAC of the gateways' receipt key, where the message sits on the
broker: its broker group, the subject pulled (the subject, or the group's retry subject), the
consumer group, the consumer id that pulled it and its position in that consumer's pull log,
and its deadline (the pull's ack timeout). Whichever gateway gets it back sends the broker a
SETTLE for that position (``qmq.broker.settle``): the broker acks it or, for a nack, puts it
on the group's retry subject; the broker decides every race between an ack and a give-back,
so an ack answered ``acked`` is never delivered again. A client cannot forge one: a receipt
whose MAC is wrong is refused.

The visibility timeout is kept twice: the pull asks the broker to hold the positions for the
ack timeout (the broker gives back what is unsettled by then, even if the gateway that pulled
it was killed), and the gateway that issued them keeps them too (``Issued``) and gives back
what is left a little after the deadline, for a broker restarted or failed over meanwhile
(its timer is memory only). Messages it still holds locally are nacked through the SDK, with
the group's back-off; others are given back at once.

The receipt key: ``$QMQ_RECEIPT_KEY`` or the file ``receipt_key_file``; else derived from the
gateway's app secret (``$QMQ_SECRET``, which every gateway of a cluster with auth shares); else
a random key of this process, whose receipts only it can settle.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hashlib
import heapq
import hmac
import logging
import os
import secrets
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal

from qmq.aio import ReceivedMessage
from qmq.common.errors import ConfigError
from qmq.gateway.errors import bad_request

log = logging.getLogger(__name__)

Outcome = Literal["acked", "nacked", "expired"]
# How often the sweeper looks for passed deadlines.
SWEEP_INTERVAL_MS: Final = 200
# The issuing gateway gives back this long after a deadline, once the broker (which holds the
# positions for the ack timeout) has had its turn; at the deadline itself when the broker did not
# take the hold.
BACKUP_GRACE_MS: Final = 3_000
# A give-back that failed is tried again this much later.
GIVE_BACK_RETRY_MS: Final = 1_000
# Receipts given back by one SETTLE at most (the broker takes 10,000 positions).
GIVE_BACKS_AT_ONCE_MAX: Final = 1_000
RECEIPT_KEY_ENV: Final = "QMQ_RECEIPT_KEY"
RECEIPT_KEY_BYTES_MIN: Final = 16
_MAC_BYTES: Final = 16
_VERSION: Final = 2  # 2 adds the sequence; receipts of version 1 are still read
_RECEIPT_CHARS_MAX: Final = 2_000


@dataclass(frozen=True, slots=True)
class Receipt:
    """Where a handed-out message sits: one position of one consumer's pull log."""

    broker_group: str
    subject: str  # the subject pulled: the message's, or its group's retry subject
    group: str
    consumer_id: str
    offset: int
    deadline_ms: int  # wall clock of the issuing gateway
    # the message's sequence in ``subject`` (-1: a receipt of version 1, without it): lets any
    # gateway read the message back for a nack with the group's back-off (qmq.gateway.nacks)
    sequence: int = -1

    @property
    def lane(self) -> tuple[str, str, str, str]:
        """What one SETTLE covers: (broker group, subject, group, consumer id)."""
        return (self.broker_group, self.subject, self.group, self.consumer_id)


def receipt_key(key_file: str, app_secret: str) -> tuple[bytes, str]:
    """The receipt key and where it came from (for the log)."""
    env = os.environ.get(RECEIPT_KEY_ENV, "")
    if env:
        raw, source = env.encode(), f"${RECEIPT_KEY_ENV}"
    elif key_file:
        try:
            raw, source = Path(key_file).read_bytes().strip(), key_file
        except OSError as exc:
            raise ConfigError(f"receipt_key_file = {key_file!r} cannot be read: {exc.strerror or exc}") from None
    elif app_secret:
        return hmac.new(app_secret.encode(), b"qmq gateway receipts v1", hashlib.sha256).digest(), "$QMQ_SECRET"
    else:
        return secrets.token_bytes(32), ""
    if len(raw) < RECEIPT_KEY_BYTES_MIN:
        raise ConfigError(
            f"the receipt key from {source} has {len(raw)} bytes; give at least {RECEIPT_KEY_BYTES_MIN} "
            "(e.g. `openssl rand -hex 32`)"
        )
    return hashlib.sha256(b"qmq gateway receipts v1\0" + raw).digest(), source


def _b64(raw: bytes) -> str:
    return base64.urlsafe_b64encode(raw).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


class ReceiptCodec:
    """Receipts as text, ``<payload>.<mac>`` (both base64url): issued and checked with one key.

    The payload is the receipt's fields, one a line (no field holds a line break: names are
    checked for whitespace, ids are made by qmq); the MAC its HMAC-SHA256, cut to 16 bytes."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, payload: bytes) -> bytes:
        return hmac.digest(self._key, payload, "sha256")[:_MAC_BYTES]

    def encode(self, r: Receipt) -> str:
        payload = (
            f"{_VERSION}\n{r.broker_group}\n{r.subject}\n{r.group}\n{r.consumer_id}\n{r.offset}\n{r.deadline_ms}"
            f"\n{r.sequence}"
        )
        raw = payload.encode()
        return f"{_b64(raw)}.{_b64(self._mac(raw))}"

    def decode(self, text: str) -> Receipt:
        """The receipt ``text`` names; 400 RECEIPT_INVALID when no gateway of the cluster issued it."""
        if len(text) > _RECEIPT_CHARS_MAX:
            raise _invalid(text, "it is longer than any receipt")
        try:
            p64, m64 = text.split(".")
            payload, mac = _unb64(p64), _unb64(m64)
        except (ValueError, TypeError):
            raise _invalid(text, "it is not a receipt") from None
        if not hmac.compare_digest(mac, self._mac(payload)):
            raise _invalid(text, "its signature does not match")
        try:
            fields = payload.decode().split("\n")
            if fields[0] == "1" and len(fields) == 7:
                fields.append("-1")
            elif fields[0] != str(_VERSION) or len(fields) != 8:
                raise _invalid(text, "it is of another version")
            _v, bg, subject, group, consumer_id, offset, deadline_ms, sequence = fields
            return Receipt(bg, subject, group, consumer_id, int(offset), int(deadline_ms), int(sequence))
        except (ValueError, UnicodeDecodeError):
            raise _invalid(text, "it cannot be read") from None


def _invalid(text: str, why: str) -> Exception:
    return bad_request(
        "RECEIPT_INVALID",
        f"receipt {text!r:.60} was not issued by a gateway of this cluster ({why}); send receipts exactly as a "
        "pull answered them. Gateways settle each other's receipts only when they share the receipt key "
        "($QMQ_RECEIPT_KEY, receipt_key_file or the app secret: docs/gateway.md); nothing in this request was settled",
    )


@dataclass(slots=True)
class Held:
    """A message this gateway handed out and holds until its deadline (event-loop time, s)."""

    message: ReceivedMessage
    receipt: Receipt
    deadline: float
    ack_timeout_ms: int
    broker_holds: bool  # the broker took the hold: it gives it back first


GiveBack = Any  # Callable[[list[Receipt]], Awaitable[dict[Receipt, bool | BaseException]]], see settle.py


class Issued:
    """The receipts this gateway handed out and not yet saw settled, and the sweeper that gives
    back those left past their deadline; also a bounded memory of what became of settled ones.

    Two kinds: those the broker holds (it gives them back at their deadline; kept here for a nack
    with the group's back-off and as a second give-back, at most ``receipts_max``, the oldest
    dropped first: a nack of a dropped one is given back at once), and those it did not take,
    which only this gateway gives back: at most ``receipts_max`` of them, past which a pull is
    refused (``room``)."""

    def __init__(self, receipts_max: int) -> None:
        self.receipts_max = receipts_max
        self._broker_held: dict[Receipt, Held] = {}  # oldest first
        self._own: dict[Receipt, Held] = {}
        # (lane, pull-log position) of every receipt held: a position a broker hands this
        # gateway's consumer again (a new master, a new connection) while it is out is not
        # handed out twice (Pulls skips it)
        self._positions: dict[tuple[tuple[str, str, str, str], int], Receipt] = {}
        self._due: list[tuple[float, int, Receipt]] = []  # a heap; entries of settled receipts are skipped
        self._order = 0
        self._outcomes: OrderedDict[Receipt, Outcome] = OrderedDict()
        self._task: asyncio.Task[None] | None = None
        self.give_back_fn: GiveBack | None = None
        self.before_sweep: Callable[[], Awaitable[None]] | None = None  # qmq.gateway.holds: holds on a new master
        self.expired = 0

    @property
    def held(self) -> int:
        return len(self._broker_held) + len(self._own)

    def room(self) -> int:
        """How many more messages a pull may hand out: the receipts only this gateway gives back are bounded."""
        return max(0, self.receipts_max - len(self._own))

    def hold(self, message: ReceivedMessage, receipt: Receipt, ack_timeout_ms: int, broker_holds: bool) -> None:
        deadline = asyncio.get_running_loop().time() + ack_timeout_ms / 1000
        self._push(Held(message, receipt, deadline, ack_timeout_ms, broker_holds))

    def _push(self, held: Held) -> None:
        if held.broker_holds:
            while len(self._broker_held) >= self.receipts_max:
                self._drop(next(iter(self._broker_held)))  # the broker gives it back in any case
            self._broker_held[held.receipt] = held
        else:
            self._own[held.receipt] = held
        self._positions[(held.receipt.lane, held.receipt.offset)] = held.receipt
        due = held.deadline + (BACKUP_GRACE_MS / 1000 if held.broker_holds else 0)
        self._order += 1
        heapq.heappush(self._due, (due, self._order, held.receipt))

    def take(self, receipt: Receipt) -> Held | None:
        held = self._broker_held.pop(receipt, None)
        if held is None:
            held = self._own.pop(receipt, None)
        if held is not None and self._positions.get((receipt.lane, receipt.offset)) == receipt:
            del self._positions[(receipt.lane, receipt.offset)]
        return held

    def _drop(self, receipt: Receipt) -> None:
        self.take(receipt)

    def is_out(self, lane: tuple[str, str, str, str], offset: int) -> bool:
        """Whether the message at ``offset`` of ``lane``'s pull log is out under a receipt of this gateway."""
        return (lane, offset) in self._positions

    def broker_held_in(self, broker_group: str) -> list[Held]:
        """The receipts of ``broker_group`` whose hold its master took (to take them again on a new master)."""
        return [h for h in self._broker_held.values() if h.receipt.broker_group == broker_group]

    def _get(self, receipt: Receipt) -> Held | None:
        held = self._broker_held.get(receipt)
        return held if held is not None else self._own.get(receipt)

    def put_back(self, held: Held, delay_ms: int) -> None:
        held.deadline = asyncio.get_running_loop().time() + delay_ms / 1000
        held.broker_holds = False
        self._push(held)

    def settled(self, receipt: Receipt, outcome: Outcome) -> None:
        self._outcomes[receipt] = outcome
        self._outcomes.move_to_end(receipt)
        while len(self._outcomes) > self.receipts_max:
            self._outcomes.popitem(last=False)

    def outcome(self, receipt: Receipt) -> Outcome | None:
        return self._outcomes.get(receipt)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._sweep_loop(), name="receipt-sweeper")

    async def stop(self) -> None:
        """Stop sweeping. What is still held stays with its clients until its deadline: any gateway
        settles it meanwhile, and the broker gives back what is left then."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _sweep_loop(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_MS / 1000)  # the sweep period, not a readiness wait
            try:
                if self.before_sweep is not None:
                    await self.before_sweep()
                await self.give_back_due()
            except Exception:  # a bug must not stop the sweeps
                log.exception("giving back expired messages failed")

    def _take_due(self) -> list[Held]:
        now = asyncio.get_running_loop().time()
        due: list[Held] = []
        heap = self._due
        while heap and heap[0][0] <= now and len(due) < GIVE_BACKS_AT_ONCE_MAX:
            _at, _n, receipt = heapq.heappop(heap)
            held = self._get(receipt)
            if held is not None and held.deadline <= now:
                self.take(receipt)
                due.append(held)
        return due

    async def give_back_due(self) -> None:
        due = self._take_due()
        if not due or self.give_back_fn is None:
            return
        results = await self.give_back_fn([h.receipt for h in due])
        for held in due:
            result = results.get(held.receipt)
            if isinstance(result, BaseException):
                log.warning(
                    "giving back message %s of %r (group %s) failed, trying again in %d ms: %s",
                    held.message.printable_id,
                    held.receipt.subject,
                    held.receipt.group,
                    GIVE_BACK_RETRY_MS,
                    result,
                )
                self.put_back(held, GIVE_BACK_RETRY_MS)
            elif result:
                self.expired += 1
                self.settled(held.receipt, "expired")
            # else settled before: acked through another gateway, or given back by the broker's hold
