"""A delay slave's copy at the store level (qmq.delay.replica): a master store's answers handed
to a slave store, with no server and no socket. The write-ahead log is copied byte for byte
and replayed into the same buckets and entry numbers, cancels included; what the master's
dispatch logs say was handed over reaches the slave's, once, however often it is sent."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from delayhelpers import T0_MS, append, manual_clock, open_store

from qmq.delay.bucket import DISPATCH_DTYPE
from qmq.delay.replica import SlaveCopy, read_for_slave
from qmq.delay.store import DelayStore
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.store.replica import ReplicaError

TOKEN = 7


def copy_all(master: DelayStore, copy: SlaveCopy, token: int = TOKEN, max_bytes: int = 4 << 20) -> int:
    """Ask and take until an answer carries nothing; how many answers carried something."""
    for answers in range(1000):
        header: dict[str, Any] = {**copy.ask(), "max_bytes": max_bytes}
        fields, parts, has_data = read_for_slave(master, token, header)
        if not has_data:
            return answers
        copy.take(Frame(RequestCode.REPLICATE, 1, fields, b"".join(parts)))
    raise AssertionError("the copy never caught up")


def wal_bytes(store: DelayStore) -> bytes:
    return store.wal.read(store.wal.start, store.wal.end - store.wal.start)


def dispatched(store: DelayStore) -> dict[int, list[int]]:
    return {b.start_ms: sorted(b.read_dispatched().tolist()) for b in store.iter_buckets()}


@pytest.fixture
def pair(tmp_path: Path) -> tuple[DelayStore, DelayStore]:
    clock = manual_clock()
    return open_store(tmp_path / "master", clock), open_store(tmp_path / "slave", clock)


def test_the_slave_copies_the_log_byte_for_byte_and_replays_it_into_the_same_entries(
    pair: tuple[DelayStore, DelayStore],
) -> None:
    master, slave = pair
    copy = SlaveCopy(slave)
    for f in range(5):  # over three buckets, one of them far ahead (sorted in at the next flush)
        append(master, [("s.a", f"m-{f}-{i}", T0_MS + 30_000 + i * 40_000) for i in range(3)])
        append(master, [("s.b", f"far-{f}", T0_MS + 86_400_000)])
    assert master.cancel("m-2-1", None) == 1
    # small answers: the log comes in several chunks, each of whole records
    assert copy_all(master, copy, max_bytes=1024) > 1
    assert slave.wal.end == master.wal.end
    assert wal_bytes(slave) == wal_bytes(master)
    master.flush_buffers()
    slave.flush_buffers()
    assert {b.start_ms: b.count for b in slave.iter_buckets()} == {b.start_ms: b.count for b in master.iter_buckets()}
    assert slave.pending_total == master.pending_total == 19
    assert dispatched(slave) == dispatched(master)  # the cancel: replayed there, copied once


def test_what_the_master_handed_over_reaches_the_slave_once(pair: tuple[DelayStore, DelayStore]) -> None:
    master, slave = pair
    copy = SlaveCopy(slave)
    append(master, [("s.a", f"m-{i}", T0_MS + 1_000 + i) for i in range(10)])
    copy_all(master, copy)
    [start] = [b.start_ms for b in master.iter_buckets()]
    master.dispatched(start, np.array([3, 1, 4], dtype=DISPATCH_DTYPE).tobytes())
    copy_all(master, copy)
    assert dispatched(slave) == {start: [1, 3, 4]}
    master.dispatched(start, np.array([5, 9], dtype=DISPATCH_DTYPE).tobytes())
    copy_all(master, copy)
    assert dispatched(slave) == {start: [1, 3, 4, 5, 9]}
    assert slave.pending_total == 5
    # a restarted master (a new token) sends its dispatch logs whole: nothing is written twice
    assert copy_all(master, copy, token=TOKEN + 1) == 1
    assert dispatched(slave) == {start: [1, 3, 4, 5, 9]}
    assert slave.buckets[start].dispatched == 5
    assert slave.pending_total == 5


def test_dispatch_tails_wait_until_the_slave_has_the_whole_log(pair: tuple[DelayStore, DelayStore]) -> None:
    master, slave = pair
    copy = SlaveCopy(slave)
    append(master, [("s.a", f"m-{i}", T0_MS + 1_000 + i) for i in range(50)], body=b"x" * 200)
    [start] = [b.start_ms for b in master.iter_buckets()]
    master.flush_buffers()
    master.dispatched(start, np.arange(50, dtype=DISPATCH_DTYPE).tobytes())
    fields, _parts, _has = read_for_slave(master, TOKEN, {**copy.ask(), "max_bytes": 1024})
    assert fields["count"] < master.wal.end
    assert fields["dispatch"] == []  # it names entries the slave does not have yet
    copy_all(master, copy, max_bytes=1024)
    assert dispatched(slave) == {start: list(range(50))}
    assert slave.pending_total == 0


def test_a_chunk_that_does_not_continue_the_copy_is_refused(pair: tuple[DelayStore, DelayStore]) -> None:
    master, slave = pair
    append(master, [("s.a", "m-1", T0_MS + 1_000)])
    fields, parts, _has = read_for_slave(master, TOKEN, {"from": 0, "action_from": 0})
    append(slave, [("s.a", "its-own", T0_MS + 1_000)])  # a copy that went its own way
    with pytest.raises(ReplicaError, match="does not continue this copy"):
        SlaveCopy(slave).take(Frame(RequestCode.REPLICATE, 1, fields, b"".join(parts)))
    with pytest.raises(ReplicaError, match="past the end of the log"):
        read_for_slave(master, TOKEN, {"from": master.wal.end + 100, "action_from": 0})
