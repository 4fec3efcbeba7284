"""Read by mypy in test_client_sdk_types.py, never run: what the SDKs' typed keywords allow.

Each line ending in ``# type: ignore[...]`` must be an error for mypy: under ``--strict``
(warn_unused_ignores) an ignore that is not needed is itself an error, so a keyword that
stops being checked fails the test.
"""

from __future__ import annotations

import qmq
import qmq.aio
from qmq.idempotency import MemoryIdempotentChecker


def blocking_sdk(url: str) -> None:
    with qmq.Producer(app_code="shop", meta_server=url, send_timeout_ms=1_000, linger_ms=1) as producer:
        producer.send(producer.generate_message("s"))
    qmq.Producer(app_code="shop", meta_server=url, send_timeout=1_000)  # type: ignore[call-arg]
    qmq.Producer(app_code="shop", meta_server=url, linger_ms="1")  # type: ignore[arg-type]
    consumer = qmq.Consumer(app_code="billing", meta_server=url, listener_threads=4, max_retries=3)
    qmq.Consumer(app_code="billing", meta_server=url, max_retry=3)  # type: ignore[call-arg]

    def handle(m: qmq.ReceivedMessage) -> None:
        m.ack()

    checker = MemoryIdempotentChecker()
    consumer.add_listener("s", "g", handle, tags=["vip"], tag_type="and", idempotent_checker=checker)
    consumer.add_listener("s", "g", handle, tag_type="xor")  # type: ignore[arg-type]
    consumer.add_listener("s", "g", handle, tag="vip")  # type: ignore[call-arg]
    consumer.add_listener("s", "g", handle, idempotent_checker=object())  # type: ignore[arg-type]
    consumer.listener("s", "g", prefetch=10, concurrency=None)(handle)
    consumer.listener("s", "g", prefech=10)  # type: ignore[call-arg]
    pull: qmq.PullConsumer = consumer.pull_consumer("s", "g", tags=["vip"], tag_type="or")
    batch: qmq.Batch = pull.pull(max_messages=10)
    batch.ack_all()
    consumer.pull_consumer("s", "g", tag_type="any")  # type: ignore[arg-type]
    late = qmq.QmqTimeoutError("the qmq call did not finish")
    timeouts: list[TimeoutError] = [late]  # a TimeoutError and a qmq error both
    failures: list[qmq.QmqError] = [late]
    assert len(timeouts) == len(failures)


async def asyncio_sdk(url: str) -> None:
    async with qmq.aio.Producer(app_code="shop", meta_server=url, max_in_flight=1) as producer:
        await producer.send(producer.generate_message("s"))
    qmq.aio.Producer(app_code="shop", meta_server=url, max_inflight=1)  # type: ignore[call-arg]
    consumer = qmq.aio.Consumer(app_code="billing", meta_server=url, check_crc=False)

    async def handle(m: qmq.aio.ReceivedMessage) -> None:
        await m.ack()

    consumer.add_listener("s", "g", handle, concurrency=4, idempotent_checker=MemoryIdempotentChecker())
    consumer.add_listener("s", "g", handle, concurrenc=4)  # type: ignore[call-arg]
    consumer.add_listener("s", "g", handle, concurrency=None)  # type: ignore[arg-type]
    consumer.listener("s", "g", tag_type="and", broadcast=True)(handle)
    consumer.listener("s", "g", tag_type="both")  # type: ignore[arg-type]
    pull: qmq.aio.PullConsumer = consumer.pull_consumer("s", "g", start_from="earliest")
    batch: qmq.aio.Batch = await pull.pull()
    await batch.ack_all()
    errors: tuple[type[qmq.aio.QmqError], ...] = (qmq.aio.SendError, qmq.aio.AlreadyProcessedError)
    assert errors
