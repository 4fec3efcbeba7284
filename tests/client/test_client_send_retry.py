"""A producer's retries end to end, through a proxy that loses or refuses frames in front of a
real broker (frameproxy.py): a send whose answer was lost after the broker stored it is sent
again and stored once (the broker's duplicate window); with ``max_in_flight=1`` sends are
stored in the order made even when a frame is retried."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from frameproxy import proxied_brokers

from qmq.aio import Consumer, Producer, PullConsumer
from qmq.protocol.codes import RequestCode, Status

pytestmark = pytest.mark.integration

SEND = RequestCode.SEND_MESSAGES


async def _ids_until(pull: PullConsumer, last: str, timeout_s: float = 20.0) -> list[str]:
    """Ids pulled (and acknowledged), in order, up to and including ``last``."""
    got: list[str] = []
    async with asyncio.timeout(timeout_s):
        while last not in got:
            batch = await pull.pull(max_messages=500, timeout_ms=500)
            batch.ack_all()
            got.extend(m.message_id for m in batch)
    return got


async def test_a_send_whose_answer_was_lost_is_sent_again_and_stored_once(meta_server: str, subject: str) -> None:
    async with proxied_brokers(meta_server) as (proxied_meta, proxies):
        [proxy] = proxies.values()
        proxy.lose_answers(SEND)
        async with Producer(app_code="shop", meta_server=proxied_meta, retry_backoff_ms=20) as producer:
            lost = producer.generate_message(subject)
            await producer.send(lost)  # returns once the retry is answered
            after = producer.generate_message(subject)
            await producer.send(after)
        assert proxy.answers_lost[SEND] == 1, "the proxy lost no answer: the test proved nothing"
        assert producer.stats.retries >= 1
        assert producer.stats.duplicates == 1  # the broker's answer to the retry: it had the message
    async with Consumer(app_code="audit", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, f"audit-{uuid.uuid4().hex[:8]}", start_from="earliest")
        # everything stored before `after`, which was sent once the retry was answered
        assert await _ids_until(pull, after.message_id) == [lost.message_id, after.message_id]


@pytest.mark.parametrize("fault", ["refused", "dropped", "answer-lost"])
async def test_max_in_flight_1_keeps_the_order_of_sends_across_a_retry(
    meta_server: str, subject: str, fault: str
) -> None:
    count = 200
    async with proxied_brokers(meta_server) as (proxied_meta, proxies):
        [proxy] = proxies.values()
        async with Producer(
            app_code="shop", meta_server=proxied_meta, max_in_flight=1, batch_messages_max=10, retry_backoff_ms=20
        ) as producer:
            await producer.prepare([subject])
            # the fault hits the third frame: two went before it, the rest must wait for its retry
            first = [producer.generate_message(subject) for _ in range(20)]
            await asyncio.gather(*[producer.send_nowait(m) for m in first])
            if fault == "refused":
                proxy.refuse_requests(SEND, Status.BUSY)
            elif fault == "dropped":
                proxy.drop_requests(SEND)
            else:
                proxy.lose_answers(SEND)
            rest = [producer.generate_message(subject) for _ in range(count - len(first))]
            await asyncio.gather(*[producer.send_nowait(m) for m in rest])
        faults = proxy.requests_refused[SEND] + proxy.requests_dropped[SEND] + proxy.answers_lost[SEND]
        assert faults == 1, "no frame was refused, dropped or left unanswered: the test proved nothing"
        assert producer.stats.retries >= 1
    sent = [m.message_id for m in [*first, *rest]]
    async with Consumer(app_code="audit", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, "audit", start_from="earliest")
        assert await _ids_until(pull, sent[-1]) == sent
