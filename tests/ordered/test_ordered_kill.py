"""Many keys × messages consumed by ordered consumer processes of one group while one is killed
with ``kill -9`` and another joins: every key's messages handled in send order (a redelivery of
a message never acknowledged may repeat, never skip or reorder), never two consumers on one key
at once, nothing lost.

The suite runs 1,000 keys × 20 messages; the issue's full size is
``QMQ_ORDERED_KEYS=10000 QMQ_ORDERED_PER_KEY=20 pytest tests/ordered/test_ordered_kill.py``.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from orderhelpers import order_problems, send_keys

from qmq.testing import ReadyProcess, running_standalone
from qmq.testing.processes import start_ready

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS = int(os.environ.get("QMQ_ORDERED_KEYS", "1000"))
PER_KEY = int(os.environ.get("QMQ_ORDERED_PER_KEY", "20"))
WORKER = str(Path(__file__).with_name("ordered_worker.py"))
LEASE_MS = 3000


def start_worker(meta_server: str, subject: str, group: str, name: str, out: Path) -> ReadyProcess:
    # 5 ms a message, 4 at a time: slow enough that the kill and the join land mid-way
    return start_ready([sys.executable, WORKER, meta_server, subject, group, name, str(out), "5", "4"])


def read_records(paths: list[Path]) -> list[tuple[str, int, int, int, str]]:
    """Every handled message: (key, n, start_ns, end_ns, consumer), by start time."""
    out = []
    for path in paths:
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                out.append((parts[0], int(parts[1]), int(parts[2]), int(parts[3]), path.stem))
    out.sort(key=lambda r: r[2])
    return out


def wait_until(what: str, ok: Callable[[], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not ok():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} did not happen within {timeout_s} s")
        time.sleep(0.2)  # polling files other processes write, bounded by the deadline


def test_the_check_catches_a_skip_a_reorder_and_an_overlap() -> None:
    assert order_problems([("a", 0), ("a", 2), ("a", 1)], ["a"], 3) != []
    assert order_problems([("a", 0), ("a", 1), ("a", 0), ("a", 1), ("a", 2)], ["a"], 3) == []  # a repeat
    assert order_problems([("a", 0)], ["a"], 2) != []  # one lost
    assert overlaps([("k0", 0, 0, 10, "c0"), ("k0", 1, 5, 20, "c1")]) != []
    assert overlaps([("k0", 0, 0, 10, "c0"), ("k0", 1, 11, 20, "c1")]) == []


def check(records: list[tuple[str, int, int, int, str]]) -> None:
    keys = [f"k{i}" for i in range(KEYS)]
    assert order_problems([(k, n) for k, n, *_ in records], keys, PER_KEY) == []
    assert overlaps(records) == []


def overlaps(records: list[tuple[str, int, int, int, str]]) -> list[str]:
    """Handlings of one key on two consumers at once (records by start time)."""
    last: dict[str, tuple[int, str]] = {}  # key -> (end of its latest handling, consumer)
    found = []
    for key, n, start, end, who in records:
        prev = last.get(key)
        if prev is not None and prev[1] != who and start < prev[0]:
            found.append(f"{key}/{n} started on {who} before {prev[1]} finished the one before")
        if prev is None or end > prev[0]:
            last[key] = (end, who)
    return found


@pytest.mark.timeout(1800)
def test_ordered_consumers_killed_and_added_keep_every_key_in_order(tmp_path: Path) -> None:
    subject, group = "orders.events", "billing"
    with running_standalone(tmp_path / "data", {"broker": {"ordered_lease_ms": LEASE_MS}}) as sa:
        outs = [tmp_path / f"c{i}.out" for i in range(5)]
        workers = [start_worker(sa.meta_server, subject, group, f"c{i}", outs[i]) for i in range(4)]
        try:
            asyncio.run(send_keys(sa.meta_server, subject, KEYS, PER_KEY))
            total = KEYS * PER_KEY
            wait_until("a third handled", lambda: len(read_records(outs)) >= total // 3, 600)
            workers[0].proc.send_signal(signal.SIGKILL)
            workers[0].proc.wait()
            workers.append(start_worker(sa.meta_server, subject, group, "c4", outs[4]))

            def all_done() -> bool:
                top: dict[str, int] = {}
                for key, n, *_ in read_records(outs):
                    top[key] = max(top.get(key, -1), n)
                return len(top) == KEYS and all(v == PER_KEY - 1 for v in top.values())

            wait_until("every key handled to its last message", all_done, 1200)
        finally:
            for w in workers:
                if w.proc.poll() is None:
                    w.stop()
                elif w.proc.stdout is not None:
                    w.proc.stdout.close()
    records = read_records(outs)
    check(records)
    by_consumer = {who: sum(r[4] == who for r in records) for who in ("c0", "c1", "c2", "c3", "c4")}
    print(f"handled by consumer: {by_consumer}; repeats: {len(records) - KEYS * PER_KEY}")
    assert all(by_consumer.values())  # the killed one worked before, the added one after
