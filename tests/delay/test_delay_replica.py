"""A delay slave's copy at the store level (qmq.delay.replica): a master store's answers handed
to a slave store, with no server and no socket. The write-ahead log is copied byte for byte
and replayed into the same buckets and entry numbers, cancels included; what the master's
dispatch logs say was handed over reaches the slave's, once, however often it is sent."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from delayhelpers import T0_MS, append, fire, manual_clock, open_store

from qmq.common.clock import ManualClock
from qmq.delay.bucket import DISPATCH, DISPATCH_DTYPE
from qmq.delay.ids import record_message_id
from qmq.delay.replica import SlaveCopy, read_for_slave
from qmq.delay.resync import Resync, remove_tree
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.store.datadir import StoreError
from qmq.store.replica import ReplicaError

TOKEN = 7


def copy_all(master: DelayStore, copy: SlaveCopy, token: int = TOKEN, max_bytes: int = 4 << 20) -> int:
    """Ask and take until an answer carries nothing; how many answers carried something."""
    for answers in range(1000):
        header: dict[str, Any] = {**copy.ask(), "max_bytes": max_bytes}
        fields, parts, has_data = read_for_slave(master, token, header)
        if not has_data:
            return answers
        pending = copy.take(Frame(RequestCode.REPLICATE, 1, fields, b"".join(parts)))
        if pending is not None:  # a copy made anew, swapped in
            asyncio.run(_awaited(pending))
    raise AssertionError("the copy never caught up")


async def _awaited(pending: Awaitable[None]) -> None:
    await pending


def checkpoint(store: DelayStore) -> int:
    """A checkpoint as the server makes one, with no slave to keep segments for; segments deleted."""
    job = store.checkpoint_job()
    job.run()
    return store.after_checkpoint(job)


def install_into(slave: DelayStore) -> Callable[[Resync], Awaitable[None]]:
    async def install(resync: Resync) -> None:
        assert resync.checkpoint is not None
        slave.install_copy(resync.staging, resync.checkpoint)

    return install


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


def test_a_far_bucket_takes_its_messages_in_log_order_however_they_were_batched(
    pair: tuple[DelayStore, DelayStore],
) -> None:
    """The slave replays many sends as one run; the master took them one send at a time. A send
    due within one far bucket joins that bucket's messages waiting for the flush, so the entry
    numbers are the same on both (before, it went into the bucket at once, ahead of the earlier
    send's messages still waiting: the slave's entries then named other messages than the
    master's dispatch log did, and after a promotion some were never handed over)."""
    master, slave = pair
    copy = SlaveCopy(slave)
    far = T0_MS + 86_400_000
    append(master, [("s.a", "near", T0_MS + 30_000), ("s.a", "far-1", far + 1)])  # spread: far-1 waits
    append(master, [("s.a", "far-2", far + 2), ("s.a", "far-3", far + 3)])  # one bucket, the same far one
    copy_all(master, copy)  # all three sends in one answer: replayed as one run
    master.flush_buffers()
    slave.flush_buffers()
    on_master = master.buckets[far].load_index(3)["due"].tolist()
    assert on_master == [far + 1, far + 2, far + 3]  # write-ahead log order
    assert slave.buckets[far].load_index(3)["due"].tolist() == on_master


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


def test_a_slave_behind_the_masters_log_copies_its_schedule_anew_and_misses_nothing(tmp_path: Path) -> None:
    """The slave copied some, then was down while the master took many more sends and deleted the
    log segments holding them (checkpoints): asking from its old offset it is answered behind,
    copies the master's schedule as its checkpoint names it, then the log after it and the
    dispatch logs, and ends with the master's pending messages, entry for entry."""
    clock = manual_clock()
    master = open_store(tmp_path / "master", clock, wal_segment_bytes=64 * 1024)
    slave = open_store(tmp_path / "slave", clock, wal_segment_bytes=64 * 1024)
    copy = SlaveCopy(slave, install_into(slave))
    body = b"x" * 1000
    append(master, [("s.a", f"early-{i}", T0_MS + 60_000 + i) for i in range(20)], body)
    copy_all(master, copy)
    assert slave.pending_total == 20
    for f in range(30):  # the slave is down: 300 messages over buckets near and far, ~5 segments
        append(master, [("s.a", f"late-{f}-{i}", T0_MS + 90_000 + f * 61_000 + i) for i in range(10)], body)
    assert checkpoint(master) >= 3
    assert master.wal.start > slave.wal.end  # what the slave had not copied is gone from the master
    [first] = [b.start_ms for b in master.iter_buckets()][:1]
    master.dispatched(first, np.array([0, 2, 5], dtype=DISPATCH_DTYPE).tobytes())
    append(master, [("s.b", f"after-{i}", T0_MS + 70_000 + i) for i in range(5)], body)  # after the checkpoint
    assert master.cancel("late-3-4", None) == 1
    copy_all(master, copy, max_bytes=32 * 1024)  # small answers: files come in several parts
    assert not copy.resyncing
    assert slave.wal.end == master.wal.end
    master.flush_buffers()
    slave.flush_buffers()
    assert {b.start_ms: b.count for b in slave.iter_buckets()} == {b.start_ms: b.count for b in master.iter_buckets()}
    assert dispatched(slave) == dispatched(master)
    assert slave.pending_total == master.pending_total == 20 + 300 + 5 - 3 - 1
    for b in master.iter_buckets():
        assert slave.buckets[b.start_ms].load_index(b.count).tolist() == b.load_index(b.count).tolist()
    # it copies on as any slave: a later send reaches it
    append(master, [("s.a", "later", T0_MS + 65_000)], body)
    copy_all(master, copy)
    assert slave.pending_total == master.pending_total
    slave.close()
    slave = open_store(tmp_path / "slave", clock, wal_segment_bytes=64 * 1024)  # and it recovers as it is
    assert slave.pending_total == master.pending_total
    slave.close()
    master.close()


def test_a_swap_cut_short_leaves_a_store_that_starts_empty(tmp_path: Path) -> None:
    clock = manual_clock()
    slave = open_store(tmp_path, clock)
    append(slave, [("s.a", "m", T0_MS + 60_000)])
    slave.close()
    (tmp_path / "resync.installing").write_bytes(b"")
    (tmp_path / "resync" / "schedule").mkdir(parents=True)
    slave = open_store(tmp_path, clock)
    assert (slave.pending_total, slave.wal.end, list(slave.iter_buckets())) == (0, 0, [])
    assert not (tmp_path / "resync.installing").exists()
    assert not (tmp_path / "resync").exists()
    slave.close()


class _Node:
    """One delay server of a group in the failover test: its store, the scheduler firing from it
    while it is master, and its copy while it is slave."""

    def __init__(self, directory: Path, clock: ManualClock) -> None:
        self.dir = directory
        self.clock = clock
        self.store = open_store(directory, clock, wal_segment_bytes=64 * 1024)
        self.sched = Scheduler(self.store, 5_000)
        self.copy: SlaveCopy | None = None

    def follow(self) -> None:
        self.sched = Scheduler(self.store, 5_000)
        self.copy = SlaveCopy(self.store, install_into(self.store))

    def restart(self, torn: int = 0) -> None:
        """Stop (a crash cutting ``torn`` bytes off the end of one dispatch log) and recover."""
        logs = [b.directory / DISPATCH for b in self.store.iter_buckets() if (b.directory / DISPATCH).exists()]
        self.store.close()
        if torn and logs:
            path = logs[torn % len(logs)]
            data = path.read_bytes()
            path.write_bytes(data[: max(0, len(data) - torn)])
        self.store = open_store(self.dir, self.clock, wal_segment_bytes=64 * 1024)
        if self.copy is None:
            self.sched = Scheduler(self.store, 5_000)
        else:
            self.follow()


def _marked_ids(store: DelayStore) -> set[str]:
    """The message ids the store's dispatch logs mark done."""
    store.flush_buffers()
    out = set()
    for b in store.iter_buckets():
        done = np.unique(b.read_dispatched())
        assert (done < b.count).all(), f"bucket {b.start_ms}: a dispatch entry names no message"
        index = b.load_index(b.count)
        for e in done.tolist():
            out.add(record_message_id(b.read(int(index["offset"][e]), int(index["size"][e]))).decode())
    return out


@pytest.mark.parametrize("seed", range(16))
def test_dispatch_logs_copied_across_failovers_mark_only_what_was_handed_over(tmp_path: Path, seed: int) -> None:
    """Sends, hand-overs, cancels, checkpoints, restarts (some cutting a dispatch log inside an
    entry), answers of every size (a dispatch-log tail split over answers), a master's new token,
    and promotions of the slave, caught up or not, the old master cut back and following: no
    dispatch-log entry on either server ever names a message nobody handed over nor cancelled
    (it would never be handed over after a promotion: lost), and once copied the slave's dispatch
    logs are its master's."""
    rnd = random.Random(seed)
    clock = manual_clock()
    master, slave = _Node(tmp_path / "a", clock), _Node(tmp_path / "b", clock)
    slave.follow()
    token = TOKEN
    handed: set[str] = set()
    n = 0

    def answer(max_bytes: int) -> bool:
        assert slave.copy is not None
        fields, parts, has_data = read_for_slave(master.store, token, {**slave.copy.ask(), "max_bytes": max_bytes})
        if has_data:
            pending = slave.copy.take(Frame(RequestCode.REPLICATE, 1, fields, b"".join(parts)))
            if pending is not None:
                asyncio.run(_awaited(pending))
        return has_data

    for step in range(300):
        r = rnd.random()
        if r < 0.3:
            # due soon, a third of them: handed over before the slave copies them, often
            at = clock.now_ms() + (0 if rnd.random() < 0.3 else rnd.randrange(4) * 60_000)
            sends = [("s.a", f"m-{n + i}", at + rnd.randrange(59_000)) for i in range(rnd.randint(1, 8))]
            n += len(sends)
            append(master.store, sends, body=b"x" * rnd.choice([10, 300]))
        elif r < 0.35 and n:
            mid = f"m-{rnd.randrange(n)}"
            if master.store.cancel(mid, master.sched):
                handed.add(mid)
        elif r < 0.42:
            clock.advance(rnd.randint(1, 30))
            handed.update(fire(master.sched, clock))
        elif r < 0.45:
            for node in (master, slave):
                job = node.store.checkpoint_job()
                job.run()
                keep = slave.store.wal.end if node is master and rnd.random() < 0.8 else None
                node.store.after_checkpoint(job, keep)  # without keep: the slave may be behind
                node.sched.remove_finished(clock.now_ms())
        elif r < 0.48:
            node = rnd.choice([master, slave])
            node.restart(torn=rnd.choice([0, 0, 1, 3, 5, 7, 8, 12]))
            token += node is master
        elif r < 0.51 and slave.copy is not None and not slave.copy.resyncing:
            # the slave promoted; the old master cut back to where its copy ended, then following
            new, old = slave, master
            new.copy = None
            new.store.flush_buffers()
            new.sched = Scheduler(new.store, 5_000)
            old.sched.unload_all()
            if old.store.wal.end > new.store.wal.end:
                try:
                    old.store.rewind(new.store.wal.end)
                except StoreError:  # its checkpoint past the cut and its log's start gone: begun anew
                    old.store.close()
                    remove_tree(old.dir)
                    old.store = open_store(old.dir, clock, wal_segment_bytes=64 * 1024)
            old.follow()
            master, slave = new, old
            token += 1
        else:
            answer(rnd.choice([64, 100, 256, 1024, 4 << 20]))
        for node in (master, slave):
            wrong = _marked_ids(node.store) - handed
            assert not wrong, f"step {step}: {node.dir.name} marks messages never handed over: {sorted(wrong)[:5]}"
    for _ in range(1000):  # bounded: each answer moves the copy on
        if not answer(4 << 20):
            break
    on_slave = dispatched(slave.store)  # more where a crash cut the master's (handed over again)
    for start, done in dispatched(master.store).items():
        assert start not in on_slave or set(done) <= set(on_slave[start]), f"bucket {start}: not copied"
    for node in (master, slave):
        node.store.close()
