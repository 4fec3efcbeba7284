"""Repeating delay messages through real processes: N copies, each at its time and never early,
with the same message id and their own copy number (the broker's duplicate window keeps
every copy); a repeat cancelled mid-way stops; a repeat past a bound is refused by the delay
server naming it; and `kill -9` of the delay server while copies come due loses none and
delivers none twice."""

from __future__ import annotations

import os
import signal
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from delaywire import delay_group, now_ms, wait_until
from test_delay_cli import consume_json, qmq

from qmq import SendError
from qmq.aio import Consumer, Producer, PullConsumer
from qmq.protocol.message import REPEAT_COPY_PROPERTY, REPEAT_TIMES_PROPERTY
from qmq.testing import ReadyProcess, running_standalone

pytestmark = pytest.mark.integration


async def copies_of(pull: PullConsumer, count: int, timeout_s: float) -> dict[int, tuple[str, float]]:
    """Pull and ack until ``count`` copies came or the deadline: copy number -> (message id,
    receipt time ms). A copy received twice fails the test at once."""
    got: dict[int, tuple[str, float]] = {}
    deadline = time.monotonic() + timeout_s
    while len(got) < count and time.monotonic() < deadline:
        batch = await pull.pull(max_messages=100, timeout_ms=200)
        at = now_ms()
        for m in batch:
            copy = m.properties[REPEAT_COPY_PROPERTY]
            assert isinstance(copy, int)
            assert copy not in got, f"copy {copy} was delivered twice"
            got[copy] = (m.message_id, at)
        await batch.ack_all()
    return got


async def test_n_copies_come_at_their_times_never_early_with_their_numbers(
    shared_standalone: ReadyProcess, subject: str
) -> None:
    url = shared_standalone.meta_server
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url) as consumer,
    ):
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        m = producer.generate_message(subject)
        m.body = b"tick"
        m.set_repeat(every=timedelta(seconds=1), times=4)
        sent_ms = now_ms()
        await producer.send(m)
        got = await copies_of(pull, 5, timeout_s=7)  # asks for one more: none may come
    assert sorted(got) == [1, 2, 3, 4]
    assert {mid for mid, _at in got.values()} == {m.message_id}
    for k, (_mid, at) in got.items():
        due = sent_ms + k * 1000
        assert at >= due, f"copy {k} came {due - at:.0f} ms early"


async def test_the_first_copy_at_the_due_time_given_then_every_interval(
    shared_standalone: ReadyProcess, subject: str
) -> None:
    url = shared_standalone.meta_server
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url) as consumer,
    ):
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        m = producer.generate_message(subject)
        first = datetime.now(UTC) + timedelta(seconds=2)
        m.set_deliver_at(first)
        m.set_repeat(every=timedelta(seconds=1), until=first + timedelta(seconds=1, milliseconds=500))
        await producer.send(m)
        got = await copies_of(pull, 3, timeout_s=6)
    assert sorted(got) == [1, 2]
    for k, (_mid, at) in got.items():
        assert at >= first.timestamp() * 1000 + (k - 1) * 1000, f"copy {k} came early"


async def test_a_repeat_cancelled_mid_way_stops(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url) as consumer,
    ):
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        m = producer.generate_message(subject)
        m.set_repeat(every=timedelta(seconds=1), times=8)
        await producer.send(m)
        first_two = await copies_of(pull, 2, timeout_s=5)
        assert sorted(first_two) == [1, 2]
        assert await producer.cancel_delay(m.message_id) is True
        rest = await copies_of(pull, 6, timeout_s=4)
    # copy 3 may have been on its way to a broker while the cancel came (never cancelled then)
    assert set(rest) <= {3}, f"copies {sorted(rest)} came after the cancel"


async def test_a_repeat_past_a_bound_is_refused_naming_it(shared_standalone: ReadyProcess, subject: str) -> None:
    async with Producer(app_code="t", meta_server=shared_standalone.meta_server) as producer:
        m = producer.generate_message(subject)
        m.set_repeat(every=timedelta(days=1), times=800)  # the last 800 days ahead
        with pytest.raises(SendError, match="the horizon is 730 days"):
            await producer.send(m)
        big = producer.generate_message(subject)
        big.body = b"x" * 10_000
        big.set_repeat(every=timedelta(seconds=1), times=10_000)
        with pytest.raises(SendError, match="64 MiB the copies of one send may take"):
            await producer.send(big)


def test_copies_carry_how_many_there_are(shared_standalone: ReadyProcess, subject: str) -> None:
    import qmq

    url = shared_standalone.meta_server
    with qmq.Producer(app_code="t", meta_server=url) as producer:
        m = producer.generate_message(subject)
        m.set_repeat(every=1, times=2)
        producer.send(m)
    with qmq.Consumer(app_code="t", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        seen: list[int] = []
        deadline = time.monotonic() + 6
        while len(seen) < 2 and time.monotonic() < deadline:
            batch = pull.pull(max_messages=10, timeout_ms=500)
            for r in batch:
                assert r.properties[REPEAT_TIMES_PROPERTY] == 2
                seen.append(int(r.properties[REPEAT_COPY_PROPERTY]))
            batch.ack_all()
    assert sorted(seen) == [1, 2]


async def test_copies_survive_kill_9_of_the_delay_server_each_delivered_once(tmp_path: Path) -> None:
    config = {"delay": {"bucket_ms": 2_000, "preload_ms": 300, "checkpoint_interval_ms": 300}}
    subject = f"repeat.{uuid.uuid4().hex[:12]}"
    with running_standalone(tmp_path / "qmq-data", config) as standalone:
        url = standalone.meta_server
        old_address = standalone.ready["delay"]
        async with (
            Producer(app_code="t", meta_server=url) as producer,
            Consumer(app_code="t", meta_server=url) as consumer,
        ):
            pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
            messages = []
            for _ in range(20):
                m = producer.generate_message(subject)
                m.set_repeat(every=timedelta(seconds=1), times=6)
                messages.append(m)
            sent_ms = now_ms()
            for m in messages:
                await producer.send(m)
            got: dict[tuple[str, int], float] = {}
            deadline = time.monotonic() + 25
            killed = False
            while len(got) < 120 and time.monotonic() < deadline:
                if not killed and now_ms() > sent_ms + 3_200:
                    os.kill(int(standalone.ready["delay_pid"]), signal.SIGKILL)
                    killed = True
                    await wait_until(
                        "the restart of the delay server", lambda: delay_group(url)["address"] != old_address, 20
                    )
                batch = await pull.pull(max_messages=200, timeout_ms=200)
                at = now_ms()
                for r in batch:
                    key = (r.message_id, int(r.properties[REPEAT_COPY_PROPERTY]))
                    assert key not in got, f"copy {key} was delivered twice"
                    got[key] = at
                await batch.ack_all()
    assert killed
    assert set(got) == {(m.message_id, k) for m in messages for k in range(1, 7)}
    early = [key for key, at in got.items() if at < sent_ms + key[1] * 1000]
    assert not early, f"copies delivered early: {early[:5]}"


def test_send_command_repeats(shared_standalone: ReadyProcess, subject: str) -> None:
    url = shared_standalone.meta_server
    sent = qmq("send", subject, "--repeat-every", "1s", "--repeat-times", "2", "--body", "x", meta_server=url)
    assert sent.returncode == 0, sent.stderr
    docs = consume_json(subject, 2, url)
    assert {d["message_id"] for d in docs} == {sent.stdout.strip()}
    assert sorted(d["properties"][REPEAT_COPY_PROPERTY] for d in docs) == [1, 2]
    lone = qmq("send", subject, "--repeat-times", "2", meta_server=url)
    assert lone.returncode == 2
    assert "--repeat-every" in lone.stderr
    bad_until = qmq("send", subject, "--repeat-every", "1s", "--repeat-until", "tomorrow", meta_server=url)
    assert bad_until.returncode == 2
    assert "--repeat-until" in bad_until.stderr
    too_often = qmq("send", subject, "--repeat-every", "500ms", "--repeat-times", "2", meta_server=url)
    assert too_often.returncode == 2
    assert "least interval, 1 s" in too_often.stderr
