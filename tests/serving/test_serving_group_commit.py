"""One group commit covering two logs (the broker's message and action logs): writes to
either wait for the same flushes, each answered once the flush's offset for its own log
covers it."""

from __future__ import annotations

import asyncio

from qmq.serving.group_commit import GroupCommit
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
