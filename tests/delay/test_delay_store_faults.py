"""A failing disk under the delay store, through the store's fault seam (store/fileio.py): a
schedule-log write that fails leaves its files as they were and loses nothing (the buffer is
written whole later, and read from memory meanwhile); a send is stored once the write-ahead
log has it, whatever the schedule log met; a failed fsync of a schedule log, or a write that
does not clear by itself, stops checkpoints and tells the server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from delayhelpers import T0_MS, append, manual_clock, open_store
from test_delay_scheduler import checkpoint, fire

from qmq.delay.scheduler import Scheduler
from qmq.protocol.message import decode_message
from qmq.protocol.record import RECORD_HEADER_BYTES
from qmq.store import fileio
from qmq.store.datadir import StoreError

MINUTE = 60_000


@pytest.fixture(autouse=True)
def no_plan() -> Iterator[None]:
    yield
    fileio.install(None)


def test_a_schedule_log_flush_that_fails_is_written_whole_by_the_next(tmp_path: Path) -> None:
    store = open_store(tmp_path, manual_clock())
    append(store, [("s", f"a{i}", T0_MS + 3 * MINUTE) for i in range(3)])
    index_full = {"op": "write", "path": "schedule/*/index", "times": 1, "errno": "ENOSPC"}
    with fileio.faults(index_full), pytest.raises(StoreError, match="is full"):
        store.flush_buffers()  # the messages were written, then the index write failed
    append(store, [("s", f"b{i}", T0_MS + 3 * MINUTE) for i in range(3)])
    store.flush_buffers()
    b = store.buckets[T0_MS + 3 * MINUTE]
    assert (b.directory / "messages").stat().st_size == b.nbytes  # no copy left by the failed flush
    index = b.load_index(b.count)
    read = [decode_message(b.read(int(e["offset"]), int(e["size"]))[RECORD_HEADER_BYTES:]).message_id for e in index]
    assert read == ["a0", "a1", "a2", "b0", "b1", "b2"]
    assert store.failed is None  # a full disk clears by itself
    store.close()


def test_a_send_is_stored_when_its_loaded_bucket_cannot_be_written(tmp_path: Path) -> None:
    clock = manual_clock()
    store = open_store(tmp_path, clock)
    sched = Scheduler(store, 5_000)
    append(store, [("s", "first", T0_MS + 1000)])
    sched.load_due(clock.now_ms())  # the current bucket is loaded: its messages are written at once
    with fileio.faults({"op": "write", "path": "schedule/*/messages", "errno": "ENOSPC"}) as plan:
        result = append(store, [("s", "second", T0_MS + 2000)])
        assert plan.rules[0].acted == 1
    assert result.stored == 1
    assert len(result.arrivals) == 1  # in the timer, though not yet on disk
    sched.timer.add(result.arrivals)  # what the dispatcher does with them
    clock.advance(2.0)
    assert fire(sched, clock) == ["first", "second"]  # read from the buffer it stayed in
    checkpoint(store)  # which the next flush writes
    b = store.buckets[T0_MS]
    assert (b.directory / "messages").stat().st_size == b.nbytes
    assert store.failed is None
    store.close()


def test_a_failed_fsync_of_a_schedule_log_stops_checkpoints_and_tells_the_server(tmp_path: Path) -> None:
    store = open_store(tmp_path, manual_clock())
    told: list[BaseException] = []
    store.on_disk_error = told.append
    append(store, [("s", "a", T0_MS + 3 * MINUTE)])
    job = store.checkpoint_job()
    with (
        fileio.faults({"op": "fsync", "path": "schedule/*/messages", "errno": "EIO"}),
        pytest.raises(OSError, match="injected"),
    ):
        job.run()
    assert len(told) == 1
    assert store.failed is not None
    # the next checkpoint would fsync nothing of that file again and name its size as durable
    with pytest.raises(StoreError, match="writes no checkpoint: restart it"):
        store.checkpoint_job()
    store.close()


def test_a_schedule_log_write_that_does_not_clear_by_itself_tells_the_server(tmp_path: Path) -> None:
    store = open_store(tmp_path, manual_clock())
    told: list[BaseException] = []
    store.on_disk_error = told.append
    with fileio.faults({"op": "write", "path": "schedule/*/messages", "errno": "EIO"}):
        append(store, [("s", "a", T0_MS + 3 * MINUTE)])
        with pytest.raises(StoreError, match="Input/output error"):
            store.checkpoint_job()  # its flush of the buffers fails
    assert len(told) == 1
    assert store.failed is not None
    store.close()
