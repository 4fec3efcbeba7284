"""The broker's release timer for held messages (qmq.broker.release) with a real store and a real
group commit under the sync policy: every copy it appends becomes visible to pulls once what it
waits for is fsynced, whatever order the releases and the fsyncs come in.

Found by bench/delay_failover.py (issue 24): after a delay master's kill, the last few copies a
broker appended stayed invisible for good. A release whose held records were not fsynced yet
asked the group commit for a flush; the next release, whose held records were, waited behind it
in the subject but asked for none, and the flush asked for had begun before its copies were
written. With no later send to the broker, no flush ever covered them."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from qmq.broker.metrics import BrokerMetrics
from qmq.broker.pulls import ParkedPulls
from qmq.broker.release import Release
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.protocol.message import decode_message, encode_message, scan_batch
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.serving.group_commit import GroupCommit
from qmq.store.broker_store import BrokerStore
from qmq.store.segments import FlushTicket

pytestmark = pytest.mark.timeout(30)

SUBJECT = "order.due"


@dataclass
class Broker:
    """What the release timer reads of a broker (qmq.broker.release.ReleaseContext)."""

    clock: ManualClock
    store: BrokerStore
    metrics: BrokerMetrics
    parked: ParkedPulls
    flusher: GroupCommit
    role: str = "master"
    stopping: bool = False
    release: Release = field(init=False)


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    clock = ManualClock()
    store = BrokerStore(BrokerConfig(data_dir=tmp_path / "broker", group="g", flush="sync"), clock)
    store.open()
    parked = ParkedPulls(store, lambda _n: None)

    def flushed(ticket: FlushTicket) -> None:
        parked.notify(store.complete_flush(ticket))

    flusher = GroupCommit("the message log", store.begin_flush, flushed, lambda _s: None, lambda _e: None)
    b = Broker(clock, store, BrokerMetrics(store), parked, flusher)
    b.release = Release(b)
    yield b
    flusher.executor.shutdown()
    store.close()


def send_held(b: Broker, *messages: tuple[str, int]) -> None:
    """One send of (id, ms from now until due) messages, as a delay server hands them over."""
    now = b.clock.now_ms()
    body = b"".join(
        encode_message(SUBJECT.encode(), mid.encode(), b"", 0, b"", mid.encode(), now, now + ahead)
        for mid, ahead in messages
    )
    result = b.store.append(body, scan_batch(body))
    assert (result.errors, result.stored) == ([], len(messages))


def durable_seq(store: BrokerStore) -> int:
    """How many of the subject's messages are fsynced (the copies a flush covered)."""
    st = store.subjects.get(SUBJECT)
    return 0 if st is None else st.visible_seq


def pulled_ids(store: BrokerStore) -> list[str]:
    gp = store.group(SUBJECT, "g", "earliest")
    got = store.pull(gp, gp.consumer("c"), "s", 100)
    if got is None:
        return []
    data = b"".join(got.chunks)
    ids, pos = [], 0
    while pos < len(data):
        h = read_record_header(data, pos)
        assert h is not None
        ids.append(decode_message(data[pos + RECORD_HEADER_BYTES : pos + RECORD_HEADER_BYTES + h.length]).message_id)
        pos += RECORD_HEADER_BYTES + h.length
    return ids


async def test_a_copy_waiting_behind_an_earlier_copy_gets_a_flush_that_covers_it(broker: Broker) -> None:
    b = broker
    send_held(b, ("a", 10), ("b", 20))
    # the send's own fsync has begun (it covers both held records), not yet returned
    sends_flush = b.store.begin_flush()
    b.clock.advance(0.010)
    b.release._fire()  # a's held record is not durable yet: its copy waits for a flush it asks for
    assert durable_seq(b.store) == 0
    sends_flush.run()
    b.parked.notify(b.store.complete_flush(sends_flush))  # both held records durable now
    await asyncio.sleep(0)  # the flush a's copy asked for begins: it covers a's copy, not b's yet
    b.clock.advance(0.010)
    b.release._fire()  # b's held record is durable, but its copy waits behind a's
    for _ in range(500):  # bounded: the group commit's flushes run on its thread
        if b.store.unflushed_bytes == 0 and b.flusher.waiting == 0:
            break
        await asyncio.sleep(0.01)
    # A pull takes written copies at once (its answer waits for the flush covering them), but
    # READ, listings and the slaves' view go by what is durable: both copies must get there.
    assert durable_seq(b.store) == 2, "a copy was never fsynced: no flush was asked for it"
    assert pulled_ids(b.store) == ["a", "b"]
    assert b.release.released_total == 2
