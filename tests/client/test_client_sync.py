"""The blocking SDK (`from qmq import Producer, Consumer`) against a real broker."""

from __future__ import annotations

import concurrent.futures
import threading
import time
import uuid

import pytest

import qmq
from qmq import Message, SendError
from qmq.client.sync import ReceivedMessage

pytestmark = pytest.mark.integration


def _group() -> str:
    return f"g-{uuid.uuid4().hex[:8]}"


@pytest.mark.smoke
def test_a_blocking_round_trip(meta_server: str, subject: str) -> None:
    with (
        qmq.Producer(app_code="shop", meta_server=meta_server) as producer,
        qmq.Consumer(app_code="billing", meta_server=meta_server) as consumer,
    ):
        pull = consumer.pull_consumer(subject, _group(), start_from="earliest")
        msg = producer.generate_message(subject)
        msg.set_property("orderId", "42")
        msg.body = "total: 19.99 €"
        producer.send(msg)
        batch = pull.pull(max_messages=10, timeout_ms=5000)
        assert [m.message_id for m in batch] == [msg.message_id]
        [got] = batch
        assert got.get_property("orderId") == "42"
        assert got.body.decode() == "total: 19.99 €"
        assert got.times == 1
        got.ack()
        assert got.settled
        batch.ack_all()
        assert len(pull.pull(max_messages=10, timeout_ms=200)) == 0


def test_send_async_resolves_futures_and_calls_back(meta_server: str, subject: str) -> None:
    stored: list[str] = []
    failed: list[tuple[str, BaseException]] = []
    lock = threading.Lock()

    def on_success(m: Message) -> None:
        with lock:
            stored.append(m.message_id)

    def on_failed(m: Message, exc: BaseException) -> None:
        with lock:
            failed.append((m.message_id, exc))

    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        msgs = [producer.generate_message(subject) for _ in range(500)]
        futures = [producer.send_async(m, on_success=on_success, on_failed=on_failed) for m in msgs]
        done, not_done = concurrent.futures.wait(futures, timeout=20)
        assert not not_done
        assert all(f.exception() is None for f in done)
        producer.flush()
        assert producer.stats.frames_sent < 500
    assert sorted(stored) == sorted(m.message_id for m in msgs)
    assert failed == []


def test_a_closed_blocking_producer_refuses(meta_server: str, subject: str) -> None:
    producer = qmq.Producer(app_code="shop", meta_server=meta_server)
    producer.close()
    producer.close()  # twice is fine
    with pytest.raises(SendError, match="closed"):
        producer.send(Message(subject))
    with pytest.raises(SendError, match="closed"):
        producer.send_async(Message(subject))


def test_plain_function_listeners_run_in_the_thread_pool(meta_server: str, subject: str) -> None:
    n = 50
    seen: set[str] = set()
    threads: set[str] = set()
    lock = threading.Lock()
    all_seen = threading.Event()
    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:
        sent = {producer.generate_message(subject) for _ in range(n)}
        for m in sent:
            producer.send_async(m)
        producer.flush()
        with qmq.Consumer(app_code="billing", meta_server=meta_server, listener_threads=4) as consumer:

            @consumer.listener(subject, _group(), start_from="earliest")
            def on_message(m: ReceivedMessage) -> None:
                with lock:
                    seen.add(m.message_id)
                    threads.add(threading.current_thread().name)
                    if len(seen) == n:
                        all_seen.set()

            assert all_seen.wait(20)
    assert seen == {m.message_id for m in sent}
    assert threads
    assert all(name.startswith("qmq-listener") for name in threads)
    assert len(threads) <= 4


def test_a_blocking_call_from_a_callback_is_refused_instead_of_hanging(meta_server: str, subject: str) -> None:
    errors: list[BaseException] = []
    done = threading.Event()
    with qmq.Producer(app_code="shop", meta_server=meta_server) as producer:

        def on_success(m: Message) -> None:
            try:
                producer.send(Message(subject))
            except RuntimeError as exc:
                errors.append(exc)
            done.set()

        producer.send_async(Message(subject), on_success=on_success)
        assert done.wait(10)
    assert len(errors) == 1
    assert "callback" in str(errors[0])


def test_a_blocking_nack_brings_the_message_back_with_times_2(meta_server: str, subject: str) -> None:
    with (
        qmq.Producer(app_code="shop", meta_server=meta_server) as producer,
        qmq.Consumer(app_code="billing", meta_server=meta_server, retry_pull_interval_ms=20) as consumer,
    ):
        pull = consumer.pull_consumer(subject, _group(), start_from="earliest", retry_backoff=[0])
        msg = producer.generate_message(subject)
        producer.send(msg)
        [first] = pull.pull(max_messages=10, timeout_ms=5000)
        first.nack(ValueError("later"))  # returns once the retry copy is stored
        again: list[ReceivedMessage] = []
        deadline = time.monotonic() + 10
        while not again and time.monotonic() < deadline:
            again = list(pull.pull(max_messages=10, timeout_ms=200))
        assert [(m.message_id, m.times, m.subject) for m in again] == [(msg.message_id, 2, subject)]
        again[0].ack()
