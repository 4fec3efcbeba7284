"""A failing disk under the broker's store, through its fault seam (store/fileio.py): a read
that fails fails that pull only and records nothing of it; a write the disk refused as full
leaves nothing behind and the next one works; a failed fsync, or an action-log write that
fails, stops the store until a restart."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

import pytest

from conftest import append, batch, flush
from qmq.serving.group_commit import GroupCommit
from qmq.store import fileio
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import DiskFullError, StoreError
from qmq.store.segments import FlushTicket
from qmq.store.take import PullReadError


@pytest.fixture(autouse=True)
def no_plan() -> Iterator[None]:
    yield
    fileio.install(None)


@pytest.mark.parametrize("path", ["log/*.log", "consume/*/*.cl"])
def test_a_read_that_fails_fails_that_pull_and_records_nothing(
    open_store: Callable[..., BrokerStore], path: str
) -> None:
    store = open_store()
    append(store, batch("s", [f"m{i}" for i in range(5)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    actions = store.alog.end
    with fileio.faults({"op": "read", "path": path, "times": 1, "errno": "EIO"}):
        with pytest.raises(PullReadError, match="nothing was handed out, so pull again") as failed:
            store.pull(gp, cp, "session-1", 10)
        assert "Input/output error" in str(failed.value)
        assert store.alog.end == actions  # no pull logged
        assert (gp.pull_offset, cp.pull_log_end) == (0, 0)
        result = store.pull(gp, cp, "session-1", 10)
    assert result is not None
    assert result.messages == 5
    assert result.runs == [[0, 5]]
    assert store.failed is None


def test_a_read_that_fails_among_a_pulls_scattered_records_fails_that_pull_and_records_nothing(
    open_store: Callable[..., BrokerStore],
) -> None:
    """Records of two subjects alternate, so a pull reads each of its own apart: the third read fails."""
    store = open_store()
    append(store, b"".join(batch(s, [f"{s}{i}"]) for i in range(6) for s in ("s", "t")))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    actions = store.alog.end
    with fileio.faults({"op": "read", "path": "log/*.log", "after": 2, "times": 1, "errno": "EIO"}):
        with pytest.raises(PullReadError, match="nothing was handed out, so pull again"):
            store.pull(gp, cp, "session-1", 10)
        assert store.alog.end == actions
        assert (gp.pull_offset, cp.pull_log_end) == (0, 0)
        result = store.pull(gp, cp, "session-1", 10)
    assert result is not None
    assert (result.messages, len(result.chunks), result.runs) == (6, 6, [[0, 6]])


def test_a_read_that_fails_redelivering_restores_the_consumers_cursor(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", [f"m{i}" for i in range(5)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    first = store.pull(gp, cp, "session-1", 10)
    assert first is not None
    with fileio.faults({"op": "read", "path": "log/*.log", "times": 1, "errno": "EIO"}):
        with pytest.raises(PullReadError):
            store.pull(gp, cp, "session-2", 10)  # a consumer that came back: its unacked again
        again = store.pull(gp, cp, "session-2", 10)
    assert again is not None
    assert again.runs == first.runs  # handed again, not skipped by a cursor the failed pull moved


def test_an_action_log_write_that_fails_during_a_pull_stops_the_store(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["m1"]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    failing = {"op": "write", "path": "action/*.act", "errno": "EIO"}
    with fileio.faults(failing), pytest.raises(StoreError, match="restart the broker"):
        store.pull(gp, cp, "session-1", 10)
    assert store.failed is not None
    assert "a pull failed" in store.failed


def test_a_full_disk_met_by_a_write_leaves_nothing_and_the_next_write_works(
    open_store: Callable[..., BrokerStore],
) -> None:
    store = open_store()
    append(store, batch("s", ["m1"]))
    end = store.mlog.end
    with fileio.faults({"op": "write", "path": "consume/*/*.cl", "times": 1, "errno": "ENOSPC"}):
        with pytest.raises(DiskFullError):
            append(store, batch("s", ["m2", "m3"]))  # the message log was written, then undone
        assert store.mlog.end == end
        assert append(store, batch("s", ["m2", "m3"])).stored == 2
    flush(store)
    assert store.failed is None
    gp = store.group("s", "g", "earliest")
    result = store.pull(gp, gp.consumer("c"), "session-1", 10)
    assert result is not None
    assert result.messages == 3


def test_a_failed_fsync_stops_the_store(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    with fileio.faults({"op": "fsync", "path": "log/*.log", "errno": "EIO"}):
        assert append(store, batch("s", ["m1"])).stored == 1
        with pytest.raises(OSError, match="injected"):
            flush(store)
    assert store.failed is not None
    assert "an fsync failed" in store.failed
    with pytest.raises(StoreError, match="restart the broker"):
        append(store, batch("s", ["m2"]))


async def test_a_flush_whose_completion_fails_still_answers_its_writes() -> None:
    """What the role makes true after a flush (visibility, parked pulls) failing must not leave
    the writes that flush made durable unanswered, nor stop the group commit."""
    answers: list[str | None] = []

    def complete(_ticket: FlushTicket) -> None:
        raise RuntimeError("a parked pull failed")

    gc = GroupCommit("the test log", lambda: FlushTicket([], 10), complete, lambda _s: None, lambda _e: None)
    try:
        gc.after_write(5, answers.append)
        gc.after_write(10, answers.append)
        await asyncio.wait_for(gc.drain(5.0), 10)
        assert answers == [None, None]
        assert gc.failed is None
        gc.after_write(10, answers.append)
        await asyncio.wait_for(gc.drain(5.0), 10)
        assert answers == [None, None, None]
    finally:
        await gc.stop()
