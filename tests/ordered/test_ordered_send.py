"""Ordered sends: the order-key API, slot placement, and per-key send order through a real
`qmq standalone` (the producer side of docs/ordered.md)."""

from __future__ import annotations

import asyncio
import random
import uuid

import pytest

from qmq import InvalidMessageError, SendError
from qmq.aio import Consumer, Message, Producer
from qmq.common.ordering import ORDER_KEY_PROPERTY, SLOTS, group_of_slot, slot_of
from qmq.protocol.message import ORDER_SLOT, ORDER_SLOT_POS, decode_message, with_times


def test_an_order_key_is_a_str_of_1_to_128_characters() -> None:
    m = Message("s")
    for bad in ("", "x" * 129, 42, None, "\ud800"):
        with pytest.raises(InvalidMessageError, match="order key"):
            m.set_order_key(bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidMessageError, match="best_effort"):
        m.set_order_key("k", order="loose")  # type: ignore[arg-type]
    m.set_order_key("x" * 128, order="best_effort")
    assert (m.order_key, m.order) == ("x" * 128, "best_effort")
    assert Message("s").order_key is None


def test_the_slot_is_in_the_header_and_the_key_in_the_properties() -> None:
    m = Message("s", body=b"b")
    m.set_order_key("order-42")
    encoded = m.encode()
    (order_slot,) = ORDER_SLOT.unpack_from(encoded, ORDER_SLOT_POS)
    assert order_slot == slot_of("order-42") + 1
    fields = decode_message(encoded)
    assert fields.body == b"b"
    plain = Message("s").encode()
    assert ORDER_SLOT.unpack_from(plain, ORDER_SLOT_POS) == (0,)  # as every message stored before
    assert ORDER_KEY_PROPERTY.encode() in bytes(fields.properties_raw)


def test_a_slot_maps_to_one_group_of_a_route_by_ranges() -> None:
    route = ("bg-c", "bg-a", "bg-b")
    assert {group_of_slot(s, route) for s in range(SLOTS)} == set(route)
    assert [group_of_slot(s, route) for s in (0, SLOTS // 3 - 1, SLOTS - 1)] == ["bg-a", "bg-a", "bg-c"]
    # the order of the route as given does not matter; the same key always lands on the same group
    assert all(group_of_slot(s, route) == group_of_slot(s, tuple(reversed(route))) for s in range(SLOTS))
    assert all(0 <= slot_of(f"k{i}") < SLOTS for i in range(1000))
    assert slot_of("order-42") == slot_of("order-42")


async def test_an_ordered_message_cannot_have_a_delay(meta_server: str, subject: str) -> None:
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_order_key("k")
        m.set_delay(60)
        with pytest.raises(InvalidMessageError, match="order key and a delay"):
            producer.send_nowait(m)


@pytest.mark.integration
async def test_a_keys_messages_are_stored_in_send_order(meta_server: str, subject: str) -> None:
    keys = [f"order-{i}" for i in range(300)]
    per_key = 20
    sends = [(k, n) for n in range(per_key) for k in keys]
    random.Random(7).shuffle(sends)  # interleave keys; each key's own numbers stay rising below
    counters = dict.fromkeys(keys, 0)
    async with Producer(app_code="t", meta_server=meta_server, max_in_flight=4) as producer:
        futures = []
        for k, _ in sends:
            m = producer.generate_message(subject)
            m.set_order_key(k)
            m.body = str(counters[k]).encode()
            counters[k] += 1
            futures.append(producer.send_nowait(m))
        await asyncio.gather(*futures)
        await producer.flush()
    seen: dict[str, list[int]] = {k: [] for k in keys}
    async with Consumer(app_code="t", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, f"g-{uuid.uuid4().hex[:8]}", "earliest")
        total = 0
        async with asyncio.timeout(30):
            while total < len(sends):
                batch = await pull.pull(max_messages=1000, timeout_ms=1000)
                for m in batch:
                    key = m.order_key
                    assert key is not None
                    assert m.order_slot == slot_of(key)
                    seen[key].append(int(m.body))
                total += len(batch)
                await batch.ack_all()
    assert all(v == list(range(per_key)) for v in seen.values())


@pytest.mark.integration
async def test_a_failed_message_fails_the_ones_of_its_key_behind_it(meta_server: str, subject: str) -> None:
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        bad = producer.generate_message(subject)
        bad.set_order_key("k")
        # the broker refuses a subject the SDK would never encode (routed by the valid one given)
        refused = with_times(bad.encode(), 1, subject=b"no spaces allowed")
        behind = producer.generate_message(subject)
        behind.set_order_key("k")
        other = producer.generate_message(subject)
        other.set_order_key("another key")
        first = asyncio.ensure_future(producer.send_encoded(subject, refused, bad.message_id, order_key="k"))
        await asyncio.sleep(0)  # the refused one goes first
        second = producer.send_nowait(behind)
        third = producer.send_nowait(other)
        await third  # other keys are not held up
        results = await asyncio.gather(first, second, return_exceptions=True)
        assert isinstance(results[0], SendError)
        assert "INVALID_SUBJECT" in str(results[0])
        assert isinstance(results[1], Exception)
        assert "earlier message of its order key 'k'" in str(results[1])
