"""One group commit covering two logs (the broker's message and action logs): writes to
either wait for the same flushes, each answered once the flush's offset for its own log
covers it."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path

import pytest

from qmq.serving.group_commit import GroupCommit
from qmq.store import fileio
from qmq.store.segments import FlushTicket


async def _settled(events: list[str], count: int) -> list[str]:
    for _ in range(200):
        if len(events) >= count:
            break
        await asyncio.sleep(0.01)  # the flush runs on its task
    return events


async def test_writes_to_both_logs_share_one_flush_and_each_waits_for_its_own_offset() -> None:
    ends = {"messages": 0, "actions": 0}
    tickets: list[FlushTicket] = []

    def begin() -> FlushTicket:
        ticket = FlushTicket([], ends["messages"], action_offset=ends["actions"])
        tickets.append(ticket)
        return ticket

    gc = GroupCommit("two logs", begin, lambda _t: None, lambda _s: None, lambda _e: None)
    actions = gc.actions()
    events: list[str] = []
    try:
        ends["messages"], ends["actions"] = 100, 40
        gc.after_write(100, lambda error: events.append(f"send {error}"))
        actions.after_write(40, lambda error: events.append(f"ack {error}"))
        assert gc.waiting == 2
        assert actions.waiting == 1
        assert await _settled(events, 2) == ["send None", "ack None"]
        assert len(tickets) == 1  # one flush answered both
        # an ack past what a flush covers of the action log waits for the next one, even when
        # the message log's offset is far beyond the ack's
        ends["actions"] = 50
        actions.after_write(60, lambda error: events.append(f"late ack {error}"))
        await asyncio.sleep(0)
        ends["actions"] = 60
        assert await _settled(events, 3) == ["send None", "ack None", "late ack None"]
        assert tickets[-1].action_offset == 60
        assert await actions.drain(1.0)
    finally:
        await gc.stop()


class _FailingTicket(FlushTicket):
    def run(self) -> None:
        raise OSError(5, "Input/output error")


async def test_a_failed_flush_answers_the_waiting_writes_of_both_logs_with_the_error() -> None:
    def begin() -> FlushTicket:
        return _FailingTicket([], 10, action_offset=10)

    failures: list[BaseException] = []
    gc = GroupCommit("two logs", begin, lambda _t: None, lambda _s: None, failures.append)
    events: list[str | None] = []
    try:
        gc.after_write(10, events.append)
        gc.actions().after_write(10, events.append)
        await _settled(events, 2)  # type: ignore[arg-type]
        assert len(events) == 2
        assert all(e is not None and "Input/output error" in e for e in events)
        assert gc.actions().failed is gc.failed is failures[0]
    finally:
        await gc.stop()


class _WhereRun(FlushTicket):
    """A ticket of real fdatasyncs that notes the thread each ran on."""

    def __init__(self, fds: list[int], offset: int, threads: list[str]) -> None:
        super().__init__(fds, offset)
        self.threads = threads

    def run(self) -> None:
        self.threads.append(threading.current_thread().name)
        super().run()


def _commit_of_a_file(path: Path, threads: list[str], on_loop_max_s: float) -> tuple[GroupCommit, int]:
    fd = fileio.open(path, os.O_WRONLY | os.O_CREAT)
    flushed: list[int] = []

    def begin() -> FlushTicket:
        flushed.append(len(flushed))
        return _WhereRun([fileio.dup(fd)], len(flushed), threads)

    gc = GroupCommit("a file", begin, lambda _t: None, lambda _s: None, lambda _e: None, on_loop_max_s)
    return gc, fd


async def _write_and_wait(gc: GroupCommit, fd: int, offset: int) -> None:
    fileio.write_all(fd, b"x" * 100)
    answered = asyncio.get_running_loop().create_future()
    gc.after_write(offset, answered.set_result)
    assert await asyncio.wait_for(answered, 10) is None


@pytest.mark.parametrize(("bound_s", "on_loop"), [(1.0, True), (0.0, False)])
async def test_with_a_bound_the_flushes_that_answer_writes_fsync_on_the_loops_thread(
    tmp_path: Path, bound_s: float, on_loop: bool
) -> None:
    threads: list[str] = []
    gc, fd = _commit_of_a_file(tmp_path / "log", threads, bound_s)
    try:
        await _write_and_wait(gc, fd, 1)
        await _write_and_wait(gc, fd, 2)
    finally:
        await gc.stop()
        fileio.close(fd)
    loop_thread = threading.current_thread().name
    assert (threads == [loop_thread] * 2) is on_loop, threads
    assert gc.flushes_on_loop == (2 if on_loop else 0)


async def test_a_stalled_flush_on_the_loop_sends_the_next_ones_to_the_fsync_threads(tmp_path: Path) -> None:
    threads: list[str] = []
    gc, fd = _commit_of_a_file(tmp_path / "log", threads, on_loop_max_s=0.004)
    try:
        # 100 ms: over 20 times the bound, a stall
        with fileio.faults({"op": "fsync", "delay_ms": 100, "times": 1}) as plan:
            await _write_and_wait(gc, fd, 1)
        assert plan.rules[0].acted == 1
        await _write_and_wait(gc, fd, 2)
    finally:
        await gc.stop()
        fileio.close(fd)
    loop_thread = threading.current_thread().name
    assert threads[0] == loop_thread
    assert threads[1].startswith("qmq-fsync"), threads
    assert gc.flushes_on_loop == 1


async def test_a_disk_that_stays_over_the_bound_sends_the_flushes_to_the_fsync_threads(tmp_path: Path) -> None:
    # each flush 5 ms or more, the bound 2 ms: after at most 15 flushes on the loop (fewer if a
    # loaded machine makes one of them a stall) the next run on the fsync threads
    threads: list[str] = []
    gc, fd = _commit_of_a_file(tmp_path / "log", threads, on_loop_max_s=0.002)
    try:
        with fileio.faults({"op": "fsync", "delay_ms": 5, "times": 15}):
            for offset in range(1, 16):
                await _write_and_wait(gc, fd, offset)
        await _write_and_wait(gc, fd, 16)
    finally:
        await gc.stop()
        fileio.close(fd)
    loop_thread = threading.current_thread().name
    on_loop = threads.index(next(t for t in threads if t != loop_thread))
    assert 1 <= on_loop <= 15, threads
    assert all(t.startswith("qmq-fsync") for t in threads[on_loop:]), threads
    assert gc.flushes_on_loop == on_loop


async def test_the_disk_is_judged_by_the_median_of_recent_flushes_or_by_one_stall() -> None:
    gc = GroupCommit("a log", lambda: FlushTicket([], 0), lambda _t: None, lambda _s: None, lambda _e: None, 0.002)
    try:
        for _ in range(14):  # over the bound, under 20 times it: not yet 15 to judge by
            gc._judge_disk(0.03, on_loop=True)
        assert gc._threads_until == 0.0
        gc._judge_disk(0.001, on_loop=True)  # 15: the median (30 ms) is over the bound
        assert gc._threads_until > 0.0
        gc._threads_until = 0.0
        for i in range(15):  # a median under the bound, one slow flush among them
            gc._judge_disk(0.03 if i == 7 else 0.001, on_loop=True)
        assert gc._threads_until == 0.0
        gc._judge_disk(0.05, on_loop=True)  # over 20 times the bound: a stall, at once
        assert gc._threads_until > 0.0
    finally:
        await gc.stop()
