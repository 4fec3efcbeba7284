"""Under flush = "sync" a pull takes messages written but not yet fsynced (its answer waits for
the flush that covers them and its record: the broker's handlers); after a power loss that
kept a pull's record but lost its messages, recovery cuts the pull log back."""

from __future__ import annotations

import os
from collections import deque
from collections.abc import Callable
from pathlib import Path

from conftest import append, batch, flush
from qmq.store.broker_store import BrokerStore
from qmq.store.progress import STRETCH_BITS, ConsumerProgress, Progress


def test_a_pull_takes_messages_still_waiting_for_their_fsync(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store(flush="sync")
    append(store, batch("s", ["a", "b", "c"]))
    st = store.subjects["s"]
    assert st.visible_seq == 0  # nothing fsynced yet
    gp = store.group("s", "g", "earliest")
    result = store.pull(gp, gp.consumer("c1"), "x", 10)
    assert result is not None
    assert result.messages == 3
    assert result.runs == [[0, 3]]
    flush(store)
    assert st.visible_seq == 3


def test_recovery_cuts_a_pull_log_naming_messages_lost_with_the_power(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store(flush="sync")
    append(store, batch("s", ["a", "b"]))
    flush(store)
    segment = next((tmp_path / "broker" / "log").glob("*.log"))
    durable_bytes = segment.stat().st_size
    gp = store.group("s", "g", "earliest")
    first = store.pull(gp, gp.consumer("c1"), "x", 10)
    assert first is not None
    assert first.runs == [[0, 2]]
    store.ack(gp, gp.consumers["c1"], [[0, 2]])
    append(store, batch("s", ["c", "d", "e"]))
    second = store.pull(gp, gp.consumers["c1"], "x", 10)
    assert second is not None
    assert second.runs == [[2, 3]]  # never answered: the power goes before the flush
    flush(store)  # the action log's pages reach the disk; the message log's, in this test, do not
    store.close()
    with open(segment, "r+b") as f:
        os.ftruncate(f.fileno(), durable_bytes)

    store = open_store(flush="sync")
    gp = store.progress.get("s", "g")
    assert gp is not None
    cp = gp.consumers["c1"]
    assert store.subjects["s"].next_seq == 2
    assert (cp.pull_log_end, cp.ack_offset, list(cp.runs)) == (2, 2, [])
    assert gp.pull_offset == 2
    # the next messages get the lost ones' sequences; each is handed out once, at new positions
    # (in the stretch of this start: store/progress.py)
    append(store, batch("s", ["f", "g", "h"]))
    again = store.pull(gp, cp, "y", 10)
    assert again is not None
    assert [count for _start, count in again.runs] == [3]
    assert again.runs[0][0] >= 1 << STRETCH_BITS
    assert store.pull(gp, gp.consumer("c2"), "z", 10) is None


def test_cut_pull_log_drops_only_the_tail_past_the_end() -> None:
    cp = ConsumerProgress("c", pull_log_end=30, ack_offset=5, runs=deque([[5, 105, 10], [15, 200, 15]]))
    cp.acked = [[8, 9], [20, 25]]
    cp.cursor = 30
    assert Progress.cut_pull_log(cp, 205) == 10
    assert (cp.pull_log_end, list(cp.runs), cp.acked, cp.cursor) == (20, [[5, 105, 10], [15, 200, 5]], [[8, 9]], 20)
    assert Progress.cut_pull_log(cp, 205) == 0
    assert Progress.cut_pull_log(cp, 100) == 15
    assert (cp.pull_log_end, list(cp.runs)) == (5, [])
