"""The asyncio SDK against a real `qmq standalone`: sends, pulls, acks, batching, back-pressure."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from clienthelpers import pull_until, wait_for_lag

from qmq import BufferFullError, SendError
from qmq.aio import Consumer, Message, Producer
from qmq.protocol.message import with_times
from qmq.testing import ReadyProcess, metric_value

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


@pytest.mark.smoke
async def test_a_message_round_trips_with_every_field(meta_server: str, subject: str) -> None:
    async with (
        Producer(app_code="shop", meta_server=meta_server) as producer,
        Consumer(app_code="billing", meta_server=meta_server) as consumer,
    ):
        pull = consumer.pull_consumer(subject, group=_group(), start_from="earliest")
        msg = producer.generate_message(subject)
        msg.set_property("orderId", "42")
        msg.set_property("amount", 1999)
        msg.set_property("rate", 0.25)
        msg.set_property("paid", True)
        msg.set_property("raw", b"\x00\x01")
        msg.add_tag("vip")
        msg.body = b"payload"
        await producer.send(msg)
        [got] = await pull_until(pull, 1)
    assert got.subject == subject
    assert got.message_id == msg.message_id
    assert got.get_property("orderId") == "42"
    assert got.properties == {"orderId": "42", "amount": 1999, "rate": 0.25, "paid": True, "raw": b"\x00\x01"}
    assert got.tags == ("vip",)
    assert got.body == b"payload"
    assert got.times == 1
    assert got.created_at == msg.created_at
    assert got.stored_at >= got.created_at


async def test_concurrent_sends_coalesce_into_few_frames(meta_server: str, subject: str) -> None:
    n = 500
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        msgs = [producer.generate_message(subject) for _ in range(n)]
        await asyncio.gather(*(producer.send(m) for m in msgs))
        stats = producer.stats
    assert stats.messages_stored == n
    assert stats.frames_sent < n / 10, stats
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, _group(), start_from="earliest"), n)
    assert sorted(m.message_id for m in got) == sorted(m.message_id for m in msgs)


async def test_send_nowait_futures_resolve_when_stored(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server, max_in_flight=1) as producer:
        futures = [producer.send_nowait(producer.generate_message(subject)) for _ in range(2000)]
        assert not any(f.done() for f in futures)  # nothing is stored before the loop runs
        await asyncio.gather(*futures)
        assert all(f.result() is None for f in futures)
        assert producer.buffered == 0
        assert producer.stats.frames_sent <= 2000 // producer.options.batch_messages_max + 1


async def test_a_full_buffer_refuses_at_once_and_send_waits_for_room(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server, buffer_messages_max=5) as producer:
        futures = [producer.send_nowait(producer.generate_message(subject)) for _ in range(5)]
        with pytest.raises(BufferFullError, match="buffer_messages_max=5") as info:
            producer.send_nowait(producer.generate_message(subject))
        assert info.value.retriable
        await asyncio.gather(*futures)
        # send() waits for room instead: fifty sends through a five-message buffer all succeed.
        await asyncio.gather(*(producer.send(producer.generate_message(subject)) for _ in range(50)))
        assert producer.stats.messages_stored == 55


async def test_flush_waits_and_a_closed_producer_refuses(meta_server: str, subject: str) -> None:
    producer = Producer(app_code="shop", meta_server=meta_server)
    with pytest.raises(SendError, match="not started"):
        producer.send_nowait(Message(subject))
    await producer.start()
    futures = [producer.send_nowait(Message(subject)) for _ in range(100)]
    await producer.flush()
    assert all(f.done() and f.exception() is None for f in futures)
    await producer.close()
    with pytest.raises(SendError, match="closed"):
        await producer.send(Message(subject))


async def test_start_from_earliest_sees_the_backlog_and_latest_does_not(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        before = [producer.generate_message(subject) for _ in range(3)]
        for m in before:
            await producer.send(m)
        async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
            early = consumer.pull_consumer(subject, _group(), start_from="earliest")
            late = consumer.pull_consumer(subject, _group(), start_from="latest")
            assert [m.message_id for m in await pull_until(early, 3)] == [m.message_id for m in before]
            assert len(await late.pull(max_messages=10, timeout_ms=300)) == 0
            after = producer.generate_message(subject)
            await producer.send(after)
            assert [m.message_id for m in await pull_until(late, 1)] == [after.message_id]
            assert [m.message_id for m in await pull_until(early, 1)] == [after.message_id]


async def test_a_long_poll_returns_as_soon_as_a_message_is_stored(meta_server: str, subject: str) -> None:
    async with (
        Producer(app_code="shop", meta_server=meta_server) as producer,
        Consumer(app_code="billing", meta_server=meta_server) as consumer,
    ):
        pull = consumer.pull_consumer(subject, _group())
        assert len(await pull.pull(timeout_ms=0)) == 0  # creates the group at "latest"
        waiting = asyncio.ensure_future(pull.pull(max_messages=10, timeout_ms=30_000))
        msg = producer.generate_message(subject)
        await producer.send(msg)
        batch = await asyncio.wait_for(waiting, 10)
        assert [m.message_id for m in batch] == [msg.message_id]


async def test_acks_reach_the_broker_without_another_pull(meta_server: str, subject: str) -> None:
    group = _group()
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        for _ in range(10):
            await producer.send(producer.generate_message(subject))
    async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=50) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, group, start_from="earliest"), 10, ack=False)
        answer = await wait_for_lag(meta_server, subject, group, "unacked", 10)
        for m in reversed(got):
            await m.ack()
        answer = await wait_for_lag(meta_server, subject, group, "unacked", 0)
    assert answer["consumers"][0]["ack_offset"] == 10


async def test_a_message_the_broker_refuses_fails_alone_with_the_brokers_reason(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        good = [producer.generate_message(subject) for _ in range(3)]
        bad = producer.generate_message(subject)
        # The broker refuses a subject the SDK would never encode (routed by the valid one given).
        refused = with_times(bad.encode(), 0, subject=b"no spaces allowed")
        results = await asyncio.gather(
            producer.send(good[0]),
            producer.send_encoded(subject, refused, bad.message_id),
            producer.send(good[1]),
            producer.send(good[2]),
            return_exceptions=True,
        )
    assert results[0] is None
    assert results[2] is None
    assert results[3] is None
    error = results[1]
    assert isinstance(error, SendError)
    assert not error.retriable
    assert error.message_id == bad.message_id
    assert "INVALID_SUBJECT" in str(error)
    assert "no spaces allowed" in str(error)


def _stored_count(broker_http: str, subject: str) -> float:
    """The broker's qmq_messages_in for ``subject``, read with a blocking request (no event loop)."""
    return metric_value(broker_http, "qmq_messages_in_total", subject=subject)


def _busy(seconds: float) -> None:
    """The caller's own work: holds the event loop (no await), so the sender loops cannot run."""
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def _wait_stored(broker_http: str, subject: str, count: int) -> float:
    """Poll the broker's count for ``subject`` with blocking requests (still holding the loop)."""
    deadline = time.monotonic() + 10
    while _stored_count(broker_http, subject) < count and time.monotonic() < deadline:
        time.sleep(0.01)  # polling another process's metrics, bounded by the deadline
    return _stored_count(broker_http, subject)


async def test_a_caller_that_holds_the_event_loop_still_gets_its_sends_written(
    shared_standalone: ReadyProcess, subject: str
) -> None:
    broker_http = shared_standalone.ready["broker_http"]
    async with Producer(app_code="shop", meta_server=shared_standalone.meta_server) as producer:
        await producer.send(producer.generate_message(subject))  # connected
        msgs = [producer.generate_message(subject) for _ in range(3)]
        futures = [producer.send_nowait(msgs[0])]
        _busy(0.003)
        futures.append(producer.send_nowait(msgs[1]))  # finds msgs[0] queued for 3 ms: written now
        # still without yielding, the broker (another process) stores what was written
        assert _wait_stored(broker_http, subject, 3) == 3
        futures.append(producer.send_nowait(msgs[2]))
        producer.write_now()  # written at once, whatever its age
        assert _wait_stored(broker_http, subject, 4) == 4
        await asyncio.gather(*futures)
    async with Consumer(app_code="billing", meta_server=shared_standalone.meta_server) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, _group(), start_from="earliest"), 4)
    assert [m.message_id for m in got[1:]] == [m.message_id for m in msgs]


@pytest.mark.parametrize(("max_in_flight", "frames_max"), [(2, 4), (1, 1)])
async def test_eager_writes_keep_order_and_their_bound_on_frames(
    meta_server: str, subject: str, max_in_flight: int, frames_max: int
) -> None:
    n = 400
    async with Producer(app_code="shop", meta_server=meta_server, max_in_flight=max_in_flight) as producer:
        await producer.send(producer.generate_message(subject))
        await asyncio.sleep(0)  # its frame's slot is freed a loop turn after the answer
        frames_before = producer.stats.frames_sent
        msgs = [producer.generate_message(subject) for _ in range(n)]
        futures = []
        for m in msgs:
            futures.append(producer.send_nowait(m))
            _busy(0.0002)
        # with the loop held no answer can come back: at most 2 × max_in_flight frames went out,
        # and one alone for max_in_flight=1 (which keeps order across retries)
        written = producer.stats.frames_sent - frames_before
        assert 1 <= written <= frames_max
        await asyncio.gather(*futures)
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, _group(), start_from="earliest"), n + 1)
    assert [m.message_id for m in got[1:]] == [m.message_id for m in msgs]


async def test_sends_held_for_a_route_lookup_go_before_sends_made_after_it(meta_server: str, subject: str) -> None:
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        first = producer.generate_message(subject)
        futures = [producer.send_nowait(first)]  # held: the subject's route is being looked up
        assert producer._open is not None
        meta = producer._open.meta
        for _ in range(10):  # the producer's route task starts the lookup at its first step
            if subject in meta._lookups:
                break
            await asyncio.sleep(0)
        lookup = meta._lookups[subject]
        # Woken as the lookup ends, before the producer's own task that queues the held send:
        # where a sync producer's thread can enqueue, with the route already known.
        await lookup
        later = [producer.generate_message(subject) for _ in range(3)]
        futures += [producer.send_nowait(m) for m in later]
        await asyncio.gather(*futures)
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
        got = await pull_until(consumer.pull_consumer(subject, _group(), start_from="earliest"), 4)
    assert [m.message_id for m in got] == [m.message_id for m in [first, *later]]


async def test_the_acks_of_many_subjects_go_in_one_request(shared_standalone: ReadyProcess, subject: str) -> None:
    meta_server = shared_standalone.meta_server
    broker_http = shared_standalone.ready["broker_http"]
    group = _group()
    subjects = [f"{subject}.{i}" for i in range(12)]
    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await asyncio.gather(*(producer.send(producer.generate_message(s)) for s in subjects))
    # no periodic flush meanwhile: the acks wait for flush_acks
    async with Consumer(app_code="billing", meta_server=meta_server, ack_flush_ms=60_000) as consumer:
        for s in subjects:
            await pull_until(consumer.pull_consumer(s, group, start_from="earliest"), 1)  # acked, not yet sent

        def requests(command: str) -> float:
            return metric_value(broker_http, "qmq_requests_total", command=command)

        acks, ack_manys = requests("ACK"), requests("ACK_MANY")
        await consumer.flush_acks()
        assert requests("ACK_MANY") == ack_manys + 1
        assert requests("ACK") == acks
    for s in subjects:
        await wait_for_lag(meta_server, s, group, "unacked", 0)
