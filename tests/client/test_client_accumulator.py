"""The producer's send buffer: bounds, batches per route, held subjects, expiry, flush."""

from __future__ import annotations

import asyncio
import concurrent.futures

import pytest

from qmq import BufferFullError
from qmq.client.accumulator import Accumulator, Entry


def _entry(n: int = 100, at: float = 0.0, epoch: int = 0, mid: str = "id") -> Entry:
    return (b"x" * n, concurrent.futures.Future(), mid, at, epoch, False)


def test_the_message_bound_refuses_at_once_and_release_frees_room() -> None:
    acc = Accumulator(messages_max=3, bytes_max=1 << 20)
    entries = [_entry() for _ in range(3)]
    for e in entries:
        acc.append(("b1",), e)
    with pytest.raises(BufferFullError, match="buffer_messages_max=3") as info:
        acc.append(("b1",), _entry(mid="m-4"))
    assert info.value.message_id == "m-4"
    assert info.value.retriable
    _, batch = acc.drain("b1", 10, 1 << 20) or ((), [])
    assert len(batch) == 3
    assert acc.count == 3  # in flight still counts
    acc.release(batch)
    assert acc.count == 0
    acc.append(("b1",), _entry())


def test_the_byte_bound_counts_every_buffered_byte() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1000)
    acc.append(("b1",), _entry(600))
    with pytest.raises(BufferFullError, match="buffer_bytes_max=1000"):
        acc.append(("b1",), _entry(500))
    acc.append(("b1",), _entry(400))
    assert acc.nbytes == 1000
    with pytest.raises(BufferFullError, match="larger than buffer_bytes_max"):
        acc.append(("b1",), _entry(2000))


def test_drain_respects_batch_bounds_and_sends_an_oversized_message_alone() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    for n in (100, 100, 100, 5000, 100):
        acc.append(("b1",), _entry(n))
    sizes = []
    while (got := acc.drain("b1", messages_max=2, bytes_max=1000)) is not None:
        sizes.append([len(e[0]) for e in got[1]])
    assert sizes == [[100, 100], [100], [5000], [100]]


def _ids(got: tuple[tuple[str, ...], list[Entry]] | None) -> list[str]:
    assert got is not None
    return [e[2] for e in got[1]]


def test_a_group_drains_only_the_routes_it_serves_taking_turns() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    acc.append(("b1", "b2"), _entry(mid="x1"))
    acc.append(("b2", "b3"), _entry(mid="y1"))
    acc.append(("b1", "b2"), _entry(mid="x2"))
    acc.append(("b2", "b3"), _entry(mid="y2"))
    assert _ids(acc.drain("b3", 1, 1 << 20)) == ["y1"]
    # b2 serves both routes and alternates between them
    assert _ids(acc.drain("b2", 1, 1 << 20)) == ["x1"]
    assert _ids(acc.drain("b2", 1, 1 << 20)) == ["y2"]
    assert acc.drain("b3", 1, 1 << 20) is None
    assert _ids(acc.drain("b1", 5, 1 << 20)) == ["x2"]
    assert acc.drain("b4", 1, 1 << 20) is None
    assert not acc.queued_for("b2")


def test_held_messages_wait_for_their_route() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    acc.hold("new.subject", _entry(mid="h1"))
    acc.hold("new.subject", _entry(mid="h2"))
    assert acc.count == 2
    assert acc.drain("b1", 10, 1 << 20) is None
    assert acc.held_subjects() == ["new.subject"]
    assert acc.route_held("new.subject", lambda _entry: ("b1",)) == {("b1",)}
    got = acc.drain("b1", 10, 1 << 20)
    assert got is not None
    assert [e[2] for e in got[1]] == ["h1", "h2"]


def test_expire_takes_out_old_queued_and_held_messages() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    acc.append(("b1",), _entry(at=1.0, mid="old"))
    acc.append(("b1",), _entry(at=5.0, mid="new"))
    acc.hold("s", _entry(at=2.0, mid="held-old"))
    expired = acc.expire(enqueued_before=3.0)
    assert sorted(e[2] for _, e in expired) == ["held-old", "old"]
    assert {w for w, _ in expired} == {("b1",), "s"}


async def test_flush_waits_for_what_was_buffered_before_it() -> None:
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    first = _entry(epoch=acc.epoch)
    acc.append(("b1",), first)
    done = acc.begin_flush()
    later = _entry(epoch=acc.epoch)
    acc.append(("b1",), later)
    await asyncio.sleep(0)
    assert not done.done()
    acc.release([first])
    await asyncio.wait_for(done, 1)  # the later message does not hold the flush back
    assert acc.count == 1
    assert acc.begin_flush().done() is False
    acc.release([later])


async def test_wait_for_room_returns_once_room_is_freed() -> None:
    acc = Accumulator(messages_max=1, bytes_max=1 << 20)
    e = _entry()
    acc.append(("b1",), e)
    assert await acc.wait_for_room(10, timeout_s=0.01) is False
    waiter = asyncio.ensure_future(acc.wait_for_room(10, timeout_s=5))
    await asyncio.sleep(0)
    acc.release([e])
    assert await waiter is True


@pytest.mark.timeout(10)
def test_moving_a_route_queue_may_give_messages_back_to_it() -> None:
    # a group gone from the meta server's answer: its queue goes to the rest of each message's
    # route, or stays where it was when there is none (this once spun forever)
    acc = Accumulator(messages_max=100, bytes_max=1 << 20)
    for mid in ("m1", "m2", "m3"):
        acc.append(("b2",), _entry(mid=mid))
    moved = acc.move(("b2",), lambda e: ("b1",) if e[2] == "m2" else ("b2",))
    assert moved == {("b1",), ("b2",)}
    got = acc.drain("b2", 10, 1 << 20)
    assert got is not None
    assert [e[2] for e in got[1]] == ["m1", "m3"]
    got = acc.drain("b1", 10, 1 << 20)
    assert got is not None
    assert [e[2] for e in got[1]] == ["m2"]
