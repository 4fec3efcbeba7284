"""Delay messages through `qmq standalone` and the SDK: due, never early, soon after; a past time
now; beyond the horizon refused; buckets roll over and finished ones are deleted."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from delaywire import collect, delay_group, meta_address, now_ms, request, wait_until

from qmq import SendError
from qmq.aio import Consumer, Producer
from qmq.client.connection import Connection
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import encode_message
from qmq.testing import ReadyProcess, running_standalone

pytestmark = pytest.mark.integration

# Small buckets so that a few seconds of delays span several of them (bucket_ms is for tests).
BUCKET_MS = 1_000
# How late a message may arrive on a 2-core machine shared with other test runs.
LATE_MS_MAX = 1_500


@pytest.fixture(scope="module")
def standalone(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    data_dir = tmp_path_factory.mktemp("delay") / "qmq-data"
    config = {
        "delay": {"bucket_ms": BUCKET_MS, "preload_ms": 300, "checkpoint_interval_ms": 200, "handover_lead_ms": 100}
    }
    with running_standalone(data_dir, config) as proc:
        yield proc


@pytest.fixture
def subject() -> str:
    return f"delay.{uuid.uuid4().hex[:12]}"


@pytest.mark.smoke
async def test_delayed_messages_arrive_when_due_never_before(standalone: ReadyProcess, subject: str) -> None:
    url = standalone.meta_server
    due: dict[str, int] = {}
    async with Producer(app_code="t", meta_server=url) as producer, Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        start = time.time()
        futures = []
        for i in range(60):  # due over 1.0..3.95 s: across three or four 1-second buckets
            m = producer.generate_message(subject)
            m.body = f"{i}".encode()
            if i % 2:
                m.set_delay(1.0 + i * 0.05)
            else:
                m.set_deliver_at(start + 1.0 + i * 0.05)
            due[m.message_id] = m.deliver_at_ms
            futures.append(producer.send_nowait(m))
        for f in futures:
            await f
        got = await collect(pull, len(due), timeout_s=15)
    assert set(got) == set(due)
    lateness = {mid: got[mid] - due[mid] for mid in due}
    assert min(lateness.values()) >= 0, f"delivered early: {sorted(lateness.values())[:3]} ms"
    assert max(lateness.values()) <= LATE_MS_MAX


async def test_a_message_is_handed_to_a_broker_ahead_of_its_time_and_delivered_at_it(
    standalone: ReadyProcess, subject: str
) -> None:
    """handover_lead_ms before it is due the broker has it (stored, fsynced, answered), so
    neither the hand-over nor an fsync makes it late; consumers still get it only once due."""
    url = standalone.meta_server
    address = delay_group(url)["address"]
    before = answer_of(await request(address, RequestCode.DELAY_STATS, {}))["dispatched_total"]
    async with Producer(app_code="t", meta_server=url) as producer, Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        m = producer.generate_message(subject)
        m.set_delay(1.5)
        await producer.send(m)

        async def handed_over() -> bool:
            stats = answer_of(await request(address, RequestCode.DELAY_STATS, {}))
            return bool(stats["dispatched_total"] > before)

        await wait_until("the hand-over", handed_over, timeout_s=5, interval_s=0.005)
        handed_over_at = now_ms()
        got = await collect(pull, 1, timeout_s=5)
    assert handed_over_at < m.deliver_at_ms, "the broker acknowledged the hand-over only once it was due"
    assert got[m.message_id] >= m.deliver_at_ms, "delivered before it was due"


async def test_a_message_due_milliseconds_ahead_is_not_delivered_early(standalone: ReadyProcess, subject: str) -> None:
    """Due 1-6 ms ahead: sent as a realtime message it would be consumed before its time."""
    url = standalone.meta_server
    due: dict[str, int] = {}
    async with Producer(app_code="t", meta_server=url) as producer, Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        await producer.prepare([subject])
        receiving = asyncio.ensure_future(collect(pull, 30, timeout_s=15))  # long-polling meanwhile
        sends = []
        for i in range(30):
            m = producer.generate_message(subject)
            m.set_deliver_at(time.time() + (1 + i % 6) / 1000)  # 1-2 ms: held by the broker
            due[m.message_id] = m.deliver_at_ms
            sends.append(producer.send_nowait(m))
            await asyncio.sleep(0.05)  # one at a time, each to a waiting consumer
        await asyncio.gather(*sends)
        got = await receiving
    assert set(got) == set(due)
    early = sorted(due[mid] - got[mid] for mid in due if got[mid] < due[mid])
    assert not early, f"{len(early)} of {len(due)} delivered early, by up to {early[-1]:.2f} ms"


async def test_a_time_in_the_past_is_delivered_now(standalone: ReadyProcess, subject: str) -> None:
    url = standalone.meta_server
    async with Producer(app_code="t", meta_server=url) as producer, Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        m = producer.generate_message(subject)
        m.set_deliver_at(datetime.now(UTC) - timedelta(hours=1))
        sent_at = now_ms()
        await producer.send(m)
        got = await collect(pull, 1, timeout_s=5)
    assert got[m.message_id] - sent_at < LATE_MS_MAX


async def test_a_past_time_sent_straight_to_the_delay_server_is_handed_over_at_once(
    standalone: ReadyProcess, subject: str
) -> None:
    url = standalone.meta_server
    raw = encode_message(subject.encode(), b"raw-past-1", b"", 0, b"", b"x", int(now_ms()), int(now_ms()) - 3_600_000)
    async with Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        frame = await request(delay_group(url)["address"], RequestCode.SEND_MESSAGES, {}, [raw])
        assert answer_of(frame) == {"errors": []}
        sent_at = now_ms()
        got = await collect(pull, 1, timeout_s=5)
    assert got["raw-past-1"] - sent_at < LATE_MS_MAX


async def test_the_delay_server_refuses_by_index_what_consumers_could_not_read(
    standalone: ReadyProcess, subject: str
) -> None:
    due = int(now_ms()) - 3_600_000  # handed over at once: nothing stays pending for the tests after
    good = encode_message(subject.encode(), b"good-1", b"", 0, b"", b"x", int(now_ms()), due)
    bad = encode_message(subject.encode(), b"id-\xff", b"", 0, b"", b"x", int(now_ms()), due)
    frame = await request(delay_group(standalone.meta_server)["address"], RequestCode.SEND_MESSAGES, {}, [good, bad])
    [[index, status, text]] = answer_of(frame)["errors"]
    assert (index, status) == (1, Status.INVALID_MESSAGE)
    assert "message id is not valid UTF-8" in text


async def test_a_broker_holds_a_message_due_a_moment_ahead_until_it_is_due(
    standalone: ReadyProcess, subject: str
) -> None:
    """Due a moment ahead (producers send those due within HOLD_UNTIL_DUE_MS to a broker; a delay
    server hands its messages over that early): the broker stores and answers the send at once,
    and consumers get the message once it is due, never before; a send after it is not held up."""
    url = standalone.meta_server
    broker = meta_address(url)["broker_groups"][0]["address"]
    conn = Connection(broker, connect_timeout_ms=5000)
    async with Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        try:
            await conn.request(RequestCode.PING, {}, [])  # connected before the clock starts
            due = int(now_ms()) + 300
            soon = encode_message(subject.encode(), b"soon-1", b"", 0, b"", b"x", int(now_ms()), due)
            now = encode_message(subject.encode(), b"now-1", b"", 0, b"", b"y", int(now_ms()), 0)
            frames = [await conn.request(RequestCode.SEND_MESSAGES, {}, [raw]) for raw in (soon, now)]
            answered_at = now_ms()
        finally:
            await conn.close()
        got = await collect(pull, 2, timeout_s=5)
    assert [answer_of(f) for f in frames] == [{"errors": [], "duplicates": 0}] * 2
    assert answered_at < due, "the send of a message due later was answered only once it was due"
    assert got["now-1"] < due, "a message sent after a held one waited for it"
    assert got["soon-1"] >= due, f"delivered {due - got['soon-1']:.2f} ms before it was due"
    assert got["soon-1"] - due < LATE_MS_MAX


async def test_a_broker_refuses_to_hold_a_message_due_later_than_it_holds(
    standalone: ReadyProcess, subject: str
) -> None:
    broker = meta_address(standalone.meta_server)["broker_groups"][0]["address"]
    later = encode_message(subject.encode(), b"later-1", b"", 0, b"", b"x", int(now_ms()), int(now_ms()) + 60_000)
    frame = await request(broker, RequestCode.SEND_MESSAGES, {}, [later])
    ((index, status, text),) = answer_of(frame)["errors"]
    assert (index, status) == (0, Status.INVALID_MESSAGE)
    assert "a broker holds messages due at most 1000 ms ahead; send later ones to a delay server" in text


async def test_beyond_the_horizon_the_send_fails_with_a_clear_error(standalone: ReadyProcess, subject: str) -> None:
    async with Producer(app_code="t", meta_server=standalone.meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_delay(timedelta(days=731))
        with pytest.raises(SendError) as info:
            await producer.send(m)
    text = str(info.value)
    assert "days ahead; the horizon is 730 days (horizon_days)" in text
    assert "delay group delay-1 refused it" in text
    assert not info.value.retriable


async def test_finished_buckets_are_deleted(standalone: ReadyProcess, subject: str) -> None:
    """A bucket is a directory ``schedule/<start_ms, 16 digits>/`` of the delay server's data
    directory; once its messages were delivered and a checkpoint covers them, it goes."""
    url = standalone.meta_server
    schedule = Path(standalone.ready["data_dir"]) / "delay" / "schedule"
    buckets: set[Path] = set()
    async with Producer(app_code="t", meta_server=url) as producer, Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        for i in range(5):
            m = producer.generate_message(subject)
            m.set_delay(0.5 + i * 0.3)
            await producer.send(m)
            buckets.add(schedule / f"{m.deliver_at_ms - m.deliver_at_ms % BUCKET_MS:016d}")
        await wait_until("the buckets' directories", lambda: all(b.is_dir() for b in buckets), timeout_s=5)
        assert len(await collect(pull, 5, timeout_s=10)) == 5

    def deleted() -> bool:
        return not any(b.exists() for b in buckets)

    await wait_until("deletion of the finished buckets' directories", deleted, timeout_s=15)
    address = delay_group(url)["address"]
    stats = answer_of(await request(address, RequestCode.DELAY_STATS, {"buckets_max": 500}))
    assert not [b for b in stats["buckets"] if schedule / f"{b['start_ms']:016d}" in buckets]


async def test_a_batch_spread_over_far_buckets_is_counted_in_each(standalone: ReadyProcess, subject: str) -> None:
    """Sends due minutes ahead in many buckets wait to be sorted into them in bulk (the delay
    store's flush_deferred); the stats show each in its own bucket at once."""
    url = standalone.meta_server
    async with Producer(app_code="t", meta_server=url) as producer:
        messages = []
        for i in range(20):  # sent without waiting: the producer batches them into one frame
            m = producer.generate_message(subject)
            m.set_delay(timedelta(minutes=30 + i))
            messages.append(m)
        await asyncio.gather(*[producer.send_nowait(m) for m in messages])
    stats = answer_of(await request(delay_group(url)["address"], RequestCode.DELAY_STATS, {"buckets_max": 500}))
    for m in messages:
        (bucket,) = [b for b in stats["buckets"] if b["start_ms"] <= m.deliver_at_ms < b["start_ms"] + BUCKET_MS]
        assert bucket["pending"] == 1
        assert bucket["next_due_ms"] == m.deliver_at_ms


async def test_delay_stats_answers_per_bucket(standalone: ReadyProcess, subject: str) -> None:
    url = standalone.meta_server
    async with Producer(app_code="t", meta_server=url) as producer:
        m = producer.generate_message(subject)
        m.set_delay(timedelta(minutes=10))
        await producer.send(m)
    stats = answer_of(await request(delay_group(url)["address"], RequestCode.DELAY_STATS, {"buckets_max": 500}))
    assert stats["group"] == "delay-1"
    assert stats["pending"] >= 1
    later = [b for b in stats["buckets"] if b["start_ms"] <= m.deliver_at_ms < b["start_ms"] + BUCKET_MS]
    assert later
    assert later[0]["pending"] == 1
    assert later[0]["next_due_ms"] == m.deliver_at_ms
    assert later[0]["loaded"] is False


async def test_a_delay_server_refuses_what_only_a_broker_serves(standalone: ReadyProcess) -> None:
    address = delay_group(standalone.meta_server)["address"]
    ping = await request(address, RequestCode.PING, {})
    assert ping.header["role"] == "delay"
    from qmq.common.errors import BrokerError

    with pytest.raises(BrokerError) as info:
        await request(address, RequestCode.PULL, {"subject": "s"})
    assert info.value.status == Status.UNKNOWN_COMMAND
    assert "pull from a broker" in str(info.value)
    with pytest.raises(BrokerError, match="buckets_max"):
        await request(address, RequestCode.DELAY_STATS, {"buckets_max": -1})
