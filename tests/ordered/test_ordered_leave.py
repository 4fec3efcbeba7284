"""A consumer process that closes cleanly hands its slots back at once: with the lease at its
default 20 s, the other consumer of the group starts that consumer's keys within a second of the
close, each key still in send order (what the closing one had queued and not handled comes first)."""

from __future__ import annotations

import asyncio
import signal
import sys
import time
from pathlib import Path

import pytest
from orderhelpers import order_problems, send_keys
from test_ordered_kill import WORKER, overlaps, read_records, wait_until

from qmq.aio import Consumer
from qmq.testing import ReadyProcess, running_standalone
from qmq.testing.processes import start_ready

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

KEYS = 40
PER_KEY = 20  # what b holds of its own keys fits its prefetch (512): a's keys are not queued behind them


def start_worker(meta_server: str, subject: str, group: str, name: str, out: Path) -> ReadyProcess:
    # 20 ms a message, 8 at a time: each has messages queued, not yet handled, when the other closes
    return start_ready([sys.executable, WORKER, meta_server, subject, group, name, str(out), "20", "8"])


def test_a_consumer_that_closes_hands_its_keys_to_another_within_a_second(tmp_path: Path) -> None:
    subject, group = "leave.orders", "billing"
    with running_standalone(tmp_path / "data") as sa:  # ordered_lease_ms: the default, 20 s
        outs = [tmp_path / "a.out", tmp_path / "b.out"]
        a = start_worker(sa.meta_server, subject, group, "a", outs[0])
        b = start_worker(sa.meta_server, subject, group, "b", outs[1])
        try:
            asyncio.run(send_keys(sa.meta_server, subject, KEYS, PER_KEY))
            wait_until("both consumers at work", lambda: all(len(read_records([o])) >= 40 for o in outs), 60)
            a.proc.send_signal(signal.SIGTERM)  # a clean close: running handlers end, acks go, then leave
            assert a.proc.wait(30) == 0
            closed_ns = time.time_ns()
            a_keys = {key for key, *_ in read_records([outs[0]])}

            def a_keys_done() -> bool:
                top: dict[str, int] = {}
                for key, n, *_ in read_records(outs):
                    top[key] = max(top.get(key, -1), n)
                return all(top.get(k) == PER_KEY - 1 for k in a_keys)

            wait_until("a's keys handled to their last message", a_keys_done, 60)
        finally:
            for w in (a, b):
                if w.proc.poll() is None:
                    w.stop()
                elif w.proc.stdout is not None:
                    w.proc.stdout.close()
    records = read_records(outs)
    assert order_problems([(k, n) for k, n, *_ in records], [f"k{i}" for i in range(KEYS)], PER_KEY) == []
    assert overlaps(records) == []
    top_at_close: dict[str, int] = {}
    for key, n, start, _end, _who in records:
        if key in a_keys and start < closed_ns:
            top_at_close[key] = max(top_at_close.get(key, -1), n)
    waiting = {k for k in a_keys if top_at_close.get(k, -1) < PER_KEY - 1}
    assert waiting, "a finished its keys before it closed: nothing was left to hand over"
    first_on_b: dict[str, int] = {}
    for key, _n, start, _end, who in records:
        if who == "b" and key in waiting and start >= closed_ns:
            first_on_b.setdefault(key, start)
    late = {k: (first_on_b[k] - closed_ns) / 1e9 for k in sorted(waiting)}
    # without the leave, b would wait out a's lease (20 s) for each of them
    assert max(late.values()) < 1.0, f"seconds from a's close until b started each of a's keys: {late}"


@pytest.mark.parametrize("settled", [True, False])
async def test_an_ordered_pull_consumer_leaves_at_close_only_with_nothing_unsettled(
    tmp_path: Path, settled: bool
) -> None:
    subject, group = "leave.pulls", "billing"
    with running_standalone(tmp_path / "data", {"broker": {"ordered_lease_ms": 6_000}}) as sa:
        await send_keys(sa.meta_server, subject, 4, 2)
        async with Consumer(app_code="t", meta_server=sa.meta_server, consumer_id="b") as b:
            async with Consumer(app_code="t", meta_server=sa.meta_server, consumer_id="a") as a:
                first = await a.pull_consumer(subject, group, "earliest", ordered=True).pull(
                    max_messages=100, timeout_ms=5000
                )
                assert sorted(int(m.body) for m in first) == [0] * 4  # a, alone, holds every key
                for m in first if settled else first[1:]:
                    m.ack()
                await a.flush_acks()
            pull_b = b.pull_consumer(subject, group, "earliest", ordered=True)
            got = await pull_b.pull(max_messages=100, timeout_ms=2_000)
            if settled:  # a left at its close: its keys' next messages are b's at once
                assert sorted((m.order_key, int(m.body)) for m in got) == [(f"k{i}", 1) for i in range(4)]
            else:  # a closed holding a message it never settled: its keys wait out its lease
                assert not got
