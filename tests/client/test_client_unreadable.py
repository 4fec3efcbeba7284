"""A stored message the SDK cannot read (written before the broker checked sends) is dead-lettered
with the reason, alone, and the rest of its batch goes on; an ack after close says it is lost."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from pathlib import Path

import pytest
from clienthelpers import wait_for_dead_letters

from qmq.aio import Consumer, ReceivedMessage
from qmq.common.config import BrokerConfig
from qmq.common.errors import QmqError
from qmq.protocol.message import encode_message, encode_properties, scan_batch
from qmq.store.broker_store import BrokerStore
from qmq.testing import running_standalone

pytestmark = pytest.mark.integration

SUBJECT = "orders.unreadable"
GOOD = 11


def _message(message_id: bytes, props: bytes = b"", tags: bytes = b"", tag_count: int = 0) -> bytes:
    return encode_message(SUBJECT.encode(), message_id, tags, tag_count, props, b"body", int(time.time() * 1000))


def _plant(data_dir: Path) -> None:
    """Store good and unreadable messages the way an older broker that checked nothing would have."""
    messages = [_message(f"good-{i}".encode(), encode_properties({"n": i})) for i in range(GOOD)]
    messages[3:3] = [
        _message(b"bad-id-\xff\xfe"),
        _message(b"bad-props", props=b"\xc1\xc1"),
        _message(b"bad-tag", tags=b"\x02\xff\xfe", tag_count=1),
    ]
    body = b"".join(messages)
    store = BrokerStore(BrokerConfig(data_dir=data_dir / "broker"))
    store.open()
    result = store.append(body, scan_batch(body), visible_now=True)
    assert result.stored == GOOD + 3, result
    ticket = store.begin_flush()
    ticket.run()
    store.complete_flush(ticket)
    store.close()


async def test_a_listener_dead_letters_an_unreadable_message_and_goes_on(standalone_dir: Path) -> None:
    _plant(standalone_dir)
    handled: list[str] = []
    all_good = asyncio.Event()
    with running_standalone(standalone_dir) as proc:
        async with Consumer(app_code="billing", meta_server=proc.meta_server, ack_flush_ms=20) as consumer:

            @consumer.listener(SUBJECT, "billing", start_from="earliest", concurrency=2)
            async def on_message(m: ReceivedMessage) -> None:
                handled.append(m.message_id)
                if len(handled) == GOOD:
                    all_good.set()

            await asyncio.wait_for(all_good.wait(), 30)
            letters = await wait_for_dead_letters(proc.meta_server, SUBJECT, "billing", 3)
            assert consumer.errors == []
    assert sorted(handled) == sorted(f"good-{i}" for i in range(GOOD))
    reasons = {letter["message_id"]: letter["error"] for letter in letters}
    assert set(reasons) == {"bad-id-\\xff\\xfe", "bad-props", "bad-tag"}
    assert "message id is not valid UTF-8" in reasons["bad-id-\\xff\\xfe"]
    assert "properties cannot be read" in reasons["bad-props"]
    assert "tags cannot be read" in reasons["bad-tag"]


def test_qmq_consume_prints_the_readable_and_dead_letters_the_rest(standalone_dir: Path) -> None:
    _plant(standalone_dir)
    with running_standalone(standalone_dir) as proc:
        out = subprocess.run(
            [sys.executable, "-m", "qmq", "consume", SUBJECT, "--group", "cli", "--from", "earliest",
             "--count", str(GOOD), "--meta-server", proc.meta_server],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert out.returncode == 0, out.stderr
        assert sorted(line.split()[1] for line in out.stdout.splitlines()) == sorted(f"good-{i}" for i in range(GOOD))
        assert out.stderr.count("it goes to the dead letters") == 3
        letters = asyncio.run(wait_for_dead_letters(proc.meta_server, SUBJECT, "cli", 3))
    assert len(letters) == 3


async def test_an_ack_after_the_consumer_closed_raises(meta_server: str, subject: str) -> None:
    from qmq.aio import Producer

    async with Producer(app_code="shop", meta_server=meta_server) as producer:
        await producer.send(producer.generate_message(subject))
    async with Consumer(app_code="billing", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, "late-ack", "earliest")
        batch = await pull.pull(max_messages=1, timeout_ms=10_000)
    assert len(batch) == 1
    with pytest.raises(QmqError, match="is closed"):
        batch[0].ack()
    with pytest.raises(QmqError, match="is closed"):
        batch.ack_all()
