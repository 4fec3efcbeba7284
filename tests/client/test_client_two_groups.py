"""Two broker groups behind one meta server: a subject routed to both keeps working when one
of them goes away (sends fail over, pulls go on from the other)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from clienthelpers import pull_until

from qmq.aio import Consumer, Producer
from qmq.client.meta import MetaClient
from qmq.testing import ReadyProcess, running_role, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ReadyProcess, Path]]:
    base = tmp_path_factory.mktemp("two-groups")
    with running_standalone(base / "standalone") as proc:
        yield proc, base


def _second_broker(meta_server: str, base: Path) -> list[str]:
    return [
        "broker",
        "--data-dir",
        str(base / "broker-2"),
        "--port",
        "0",
        "--http-port",
        "0",
        "--meta-server",
        meta_server,
        "--group",
        "broker-2",
    ]


async def _route(meta_server: str, subject: str) -> tuple[str, ...]:
    meta = MetaClient(meta_server, timeout_ms=5000)
    await meta.start()
    try:
        return await meta.resolve(subject)
    finally:
        await meta.close()


async def test_sends_and_pulls_go_on_when_one_broker_group_stops(
    cluster: tuple[ReadyProcess, Path], subject: str
) -> None:
    standalone, base = cluster
    url = standalone.meta_server
    with running_role(_second_broker(url, base)) as second:
        assert await _route(url, subject) == ("broker-1", "broker-2")
        async with (
            Producer(app_code="shop", meta_server=url, retry_backoff_ms=20) as producer,
            Consumer(app_code="billing", meta_server=url) as consumer,
        ):
            pull = consumer.pull_consumer(subject, "g", start_from="earliest")
            assert len(await pull.pull(timeout_ms=0)) == 0  # the group exists on both broker groups
            before = [producer.generate_message(subject) for _ in range(50)]
            for i in range(0, 50, 10):
                await asyncio.gather(*(producer.send(m) for m in before[i : i + 10]))
            got = await pull_until(pull, 50)
            assert sorted(m.message_id for m in got) == sorted(m.message_id for m in before)
            # Both broker groups of the route took sends, and the pulls found them on both.
            assert set(pull._main.trackers) == {"broker-1", "broker-2"}

            second.stop()
            after = [producer.generate_message(subject) for _ in range(200)]
            # Sends in small waves, so some frames go to broker-2 first and must fail over.
            for i in range(0, 200, 20):
                await asyncio.gather(*(producer.send(m) for m in after[i : i + 20]))
            assert producer.stats.messages_failed == 0
            assert producer.stats.retries > 0, "no frame went to the stopped broker group first"
            got_after = await pull_until(pull, 200, timeout_s=30)
            assert sorted(m.message_id for m in got_after) == sorted(m.message_id for m in after)
