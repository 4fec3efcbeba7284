"""Leases of ordered consumers through a real `qmq standalone` with a short ``ordered_lease_ms``: a
consumer silent past it loses its slots, with the messages it held, to a live one, and when it
pulls again it drops what it had queued rather than run it beside the new owner."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
from orderhelpers import send_keys

from qmq.aio import Consumer
from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

LEASE_MS = 1500


@pytest.fixture
def short_lease(tmp_path: Path) -> Iterator[ReadyProcess]:
    with running_standalone(tmp_path / "data", {"broker": {"ordered_lease_ms": LEASE_MS}}) as proc:
        yield proc


async def test_a_silent_consumer_loses_its_slots_and_drops_what_it_queued(short_lease: ReadyProcess) -> None:
    meta, subject, group = short_lease.meta_server, "lease.orders", "billing"
    await send_keys(meta, subject, 10, 3)
    async with (
        Consumer(app_code="t", meta_server=meta, consumer_id="a", ack_flush_ms=50) as a,
        Consumer(app_code="t", meta_server=meta, consumer_id="b", ack_flush_ms=50) as b,
    ):
        pull_a = a.pull_consumer(subject, group, "earliest", ordered=True)
        first = await pull_a.pull(max_messages=100, timeout_ms=5000)
        assert sorted(int(m.body) for m in first) == [0] * 10  # one of each key; the rest queued in a
        await first.ack_all()
        await a.flush_acks()
        await asyncio.sleep(LEASE_MS / 1000 * 2)  # a goes silent past its lease, its queue unacked

        pull_b = b.pull_consumer(subject, group, "earliest", ordered=True)
        got_b = []
        async with asyncio.timeout(20):
            while len(got_b) < 10:
                got_b += await pull_b.pull(max_messages=100, timeout_ms=1000)
        # b has every key now, from the first message a never acknowledged, in order
        assert sorted((m.order_key, int(m.body)) for m in got_b) == [(f"k{i}", 1) for i in range(10)]

        # a pulls again: it finds it was silent past the lease and hands out nothing it had queued
        # (without that, it would hand out the keys' second messages, which b runs now)
        for _ in range(3):
            assert not await pull_a.pull(max_messages=100, timeout_ms=300)
