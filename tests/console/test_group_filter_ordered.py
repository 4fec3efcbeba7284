"""A server-side filter and an ordered group do not mix (an ordered group takes whole slots), and
neither is silently dropped: the meta server refuses a filter on a group the brokers know as
ordered, and a broker refuses an ordered pull of a group that has a filter, each saying what to do."""

from __future__ import annotations

import asyncio

import pytest
from tests.cli.test_cli_client_commands import qmq

from qmq import QmqError
from qmq.aio import Consumer, Producer

pytestmark = pytest.mark.integration

_APPLIED_S = 1.0  # what a broker takes at most to apply a control record (qmq.broker.controls)


async def test_a_filter_on_an_ordered_group_is_refused_when_set(meta_server: str, subject: str) -> None:
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_order_key("k1")
        await producer.send(m)
    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        got = await consumer.pull_consumer(subject, "in-order", "earliest", ordered=True).pull(
            max_messages=10, timeout_ms=5000
        )
        assert len(got) == 1
    out = qmq("group", "filter", subject, "--group", "in-order", "--expr", "body.a", meta_server=meta_server)
    assert out.returncode != 0
    assert "consumes in order" in out.stderr, out.stderr
    listed = qmq("group", "filter", subject, "--group", "unordered", "--expr", "body.a", meta_server=meta_server)
    assert listed.returncode == 0, listed.stderr  # another group of the subject may have one


async def test_an_ordered_pull_of_a_filtered_group_is_refused_saying_how_to_clear_it(
    meta_server: str, subject: str
) -> None:
    out = qmq("group", "filter", subject, "--group", "later-ordered", "--expr", "body.a", meta_server=meta_server)
    assert out.returncode == 0, out.stderr  # no broker knows the group yet
    await asyncio.sleep(_APPLIED_S)  # the promise: applied by every broker within a second
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_order_key("k1")
        await producer.send(m)
    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        with pytest.raises(QmqError) as refused:
            await consumer.pull_consumer(subject, "later-ordered", "earliest", ordered=True).pull(
                max_messages=10, timeout_ms=1000
            )
    assert "server-side filter" in str(refused.value), refused.value
    assert "--clear" in str(refused.value), refused.value
