"""What users see when the broker goes away: sends retried until send_timeout_ms and then a
retriable SendError saying why; pulls that raise ConnectionLostError."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from qmq import ConnectionLostError, SendError
from qmq.aio import Consumer, Producer
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_sends_and_pulls_fail_clearly_once_the_broker_is_gone(tmp_path: Path, subject: str) -> None:
    with running_standalone(tmp_path / "qmq-data") as standalone:
        url = standalone.meta_server
        broker = standalone.ready["broker"]
        async with (
            Producer(app_code="shop", meta_server=url, send_timeout_ms=1_500, retry_backoff_ms=20) as producer,
            Consumer(app_code="billing", meta_server=url) as consumer,
        ):
            pull = consumer.pull_consumer(subject, "g")
            await producer.send(producer.generate_message(subject))
            assert len(await pull.pull(timeout_ms=0)) == 0
            standalone.stop()

            msg = producer.generate_message(subject)
            with pytest.raises(SendError) as info:
                await producer.send(msg)
            assert info.value.retriable
            assert info.value.message_id == msg.message_id
            text = str(info.value)
            assert "send_timeout_ms=1500" in text
            assert re.search(rf"broker group broker-1.*{re.escape(broker)}", text), text
            assert producer.stats.retries > 0

            with pytest.raises(ConnectionLostError, match=re.escape(broker)):
                await pull.pull(timeout_ms=100)
