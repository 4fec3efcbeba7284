"""Nacks of receipts another gateway issued, with the group's back-off.

The gateway that issued a receipt holds the message and nacks it through the SDK: a retry copy
due after the group's back-off for its attempt, then an ack. Another gateway does not hold it,
so it reads it back first: the receipt names the message's sequence in the subject pulled
(receipt version 2), which ``READ`` returns; the message then takes the same SDK path
(``Consumer``'s failure handling: the retry subject after the back-off, or the dead letters past
the group's retries), and its position is acked by SETTLE. A receipt without a sequence
(version 1), past its deadline, or whose message cannot be read back is given back at once, as
before (the broker puts it on the retry subject).

Sending the copy before the ack, as the SDK does, means a race with another settle of the same
receipt (an ack through a third gateway at the same moment) may leave one extra copy; never none.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Final

from qmq.aio import Batch, Consumer, ReceivedMessage
from qmq.client.acks import AckTracker
from qmq.client.received import parse_records
from qmq.client.subscription import make_subscription
from qmq.common.errors import QmqError
from qmq.common.naming import RETRY_PREFIX, parse_internal_subject
from qmq.gateway.receipts import Receipt
from qmq.gateway.settle import Settler
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode

log = logging.getLogger(__name__)

# reads of foreign receipts' messages one request makes at most (the rest are given back at once)
READS_MAX: Final = 1_000
# of them, read and re-sent at once
AT_ONCE: Final = 32


async def read_back(settler: Settler, consumer: Consumer, r: Receipt) -> ReceivedMessage | None:
    """The message ``r`` names, read back from its broker group as an SDK message of ``consumer``
    (its nack is the SDK's), or None when it cannot be (no sequence, gone, another record there)."""
    if r.sequence < 0:
        return None
    bg = await settler.group(r.broker_group)
    if bg is None:
        return None
    frame = await settler.pool.get(bg.address).request(
        RequestCode.READ, {"subject": r.subject, "from": r.sequence, "max": 1}
    )
    doc = answer_of(frame)
    if doc.get("first") != r.sequence or doc.get("count") != 1:
        return None  # removed by retention meanwhile
    origin = r.subject
    if r.subject.startswith(RETRY_PREFIX):
        origin = parse_internal_subject(r.subject)[1]
    tracker = AckTracker(
        r.broker_group,
        r.subject,
        r.group,
        origin,
        on_nack=consumer._fail_message,  # the SDK's own failure path, back-off and all
        subscription=make_subscription(),  # what the gateways' pull consumers subscribe with
    )
    batch = Batch()
    parse_records(bytes(frame.body), [(r.offset, 1)], origin, tracker, batch, ReceivedMessage)
    return batch[0]


async def nack_with_back_off(settler: Settler, consumer: Consumer, receipts: list[Receipt]) -> dict[Receipt, bool]:
    """Send a retry copy (after the group's back-off) of each receipt's message that can be read
    back and is not past its deadline, ``AT_ONCE`` at a time; per receipt whether that was done
    (False: give it back at once instead). The positions still need their SETTLE ack."""
    now_ms = time.time() * 1000
    at_once = asyncio.Semaphore(AT_ONCE)

    async def one(r: Receipt) -> bool:
        if now_ms >= r.deadline_ms:
            return False
        try:
            async with at_once:
                m = await read_back(settler, consumer, r)
                if m is None:
                    return False
                await m.nack()
        except (QmqError, OSError, TimeoutError) as exc:
            log.warning(
                "nack of a receipt of %r (group %s) issued by another gateway: cannot apply the back-off (%s); "
                "given back at once",
                r.subject,
                r.group,
                exc,
            )
            return False
        return True

    taken = receipts[:READS_MAX]
    done = await asyncio.gather(*(one(r) for r in taken))
    out = dict.fromkeys(receipts, False)
    out.update(zip(taken, done, strict=True))
    return out
