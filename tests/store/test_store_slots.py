"""Slot ownership of ordered consumer groups (store/slots.py), as pure state."""

from __future__ import annotations

from qmq.store.progress import GroupProgress, Progress
from qmq.store.slots import SETTLE_MS, SETTLE_QUIET_MS, OrderedGroup, is_acked


def _group(*ids: str) -> GroupProgress:
    gp = GroupProgress("s", "g", 0)
    for cid in ids:
        gp.consumer(cid)
    return gp


def test_new_slots_spread_evenly_and_a_join_moves_only_the_excess() -> None:
    og = OrderedGroup(started_ms=0)
    live = frozenset({"a", "b", "c"})
    load = og.load(live)
    for slot in range(300):
        og.place_new(slot, live, load)
    assert sorted(og.load(live).values()) == [100, 100, 100]
    bigger = live | {"d"}
    og.balance(bigger)
    assert len(og.moving) == 75  # only what the newcomer takes moves
    assert set(og.moving.values()) == {"d"}
    assert sorted(og.load(bigger).values()) == [75, 75, 75, 75]


def test_a_slot_moves_only_once_its_owner_acknowledged_what_it_was_handed_of_it() -> None:
    gp = _group("a", "b")
    og = OrderedGroup(started_ms=0)
    og.owners[7] = "a"
    a = gp.consumers["a"]
    Progress.record_pull(gp, a, [[0, 3]], 3)  # pull-log offsets 0..2 of a are messages of slot 7
    og.hand("a", 7, [0, 1, 2])
    og.delivered(a)  # the pull handed it 0..2
    og.moving[7] = "b"
    assert og.away("a") == {7}
    og.withhold("a", 7, 2)  # its pull skipped offset 2: never handed to it
    Progress.apply_ack(a, [[0, 1]])
    assert og.ready_moves(gp) == []  # offset 1 may still be running on a
    Progress.apply_ack(a, [[1, 2]])
    assert og.ready_moves(gp) == [(7, a, "b")]  # 2 is unacknowledged but a never had it


def test_a_move_called_off_is_noted_for_its_withheld_messages_to_go_back() -> None:
    og = OrderedGroup(started_ms=0)
    og.owners.update({1: "a", 2: "a"})
    og.moving.update({1: "b", 2: "c"})
    og.orphaned(frozenset({"a", "c"}))  # b left
    assert og.cancelled == [1]
    assert og.moving == {2: "c"}


def test_liveness_counts_a_parked_poll_and_a_fresh_start() -> None:
    gp = _group("a", "b", "c")
    gp.consumers["a"].last_seen_ms = 10_000
    gp.consumers["b"].parked = 1
    og = OrderedGroup(started_ms=0)
    assert og.live(gp, 25_000, 20_000, "c") == {"a", "b", "c"}
    assert og.live(gp, 31_000, 20_000, "c") == {"b", "c"}
    # a state made after a start or promotion counts every known consumer as just seen
    assert OrderedGroup(started_ms=30_000).live(gp, 31_000, 20_000, "c") == {"a", "b", "c"}


def test_is_acked_reads_the_prefix_and_the_ranges_beyond_it() -> None:
    gp = _group("a")
    a = gp.consumers["a"]
    Progress.record_pull(gp, a, [[0, 10]], 10)
    Progress.apply_ack(a, [[0, 2], [5, 7]])
    assert [p for p in range(10) if is_acked(a, p)] == [0, 1, 5, 6]


def test_an_owner_gone_orphans_its_slots() -> None:
    og = OrderedGroup(started_ms=0)
    og.owners.update({1: "a", 2: "b", 3: "a"})
    og.moving[2] = "a"
    assert og.orphaned(frozenset({"b"})) == {"a": [1, 3]}
    assert not og.moving  # a move to a consumer gone is dropped


def test_a_slot_moves_at_once_when_its_owner_was_never_handed_its_messages() -> None:
    gp = _group("a", "b")
    og = OrderedGroup(started_ms=0)
    og.owners[7] = "a"
    a = gp.consumers["a"]
    Progress.record_pull(gp, a, [[0, 2]], 2)  # a pull of a hands it offsets 0 and 1 (slot 3)
    og.hand("a", 3, [0, 1])
    og.delivered(a)
    cursor = a.cursor
    Progress.record_pull(gp, a, [[2, 3]], 5)  # dispatched to a's pull log, not handed to it yet
    a.cursor = cursor
    og.hand("a", 7, [2, 3, 4])
    og.moving[7] = "b"
    assert og.ready_moves(gp) == [(7, a, "b")]  # nothing of slot 7 can be running on a
    og.moving[3] = "b"
    assert (3, a, "b") not in og.ready_moves(gp)  # 0 and 1 may be


def test_slots_are_placed_once_consumers_stop_joining_or_after_the_settle_at_most() -> None:
    quiet = SETTLE_QUIET_MS
    og = OrderedGroup(started_ms=1_000)
    assert og.settle_left_ms("a", 1_000) == quiet
    assert og.settle_left_ms("b", 1_000 + quiet // 2) == quiet  # a join starts the quiet time again
    assert og.settle_left_ms("a", 1_000 + quiet) == quiet // 2  # a pull of one that joined does not
    assert og.settle_left_ms("a", 1_000 + quiet // 2 + quiet) == 0
    assert og.settle_left_ms("c", 1_000 + 2 * quiet) == 0  # placing never settles again
    busy = OrderedGroup(started_ms=0)
    for t in range(0, SETTLE_MS, SETTLE_QUIET_MS // 2):
        assert busy.settle_left_ms(f"c{t}", t) > 0
    assert busy.settle_left_ms("late", SETTLE_MS) == 0  # joins that go on do not hold it past SETTLE_MS


def test_a_consumer_that_left_is_not_live_until_it_pulls() -> None:
    gp = _group("a", "b")
    gp.consumers["a"].parked = 1
    og = OrderedGroup(started_ms=0)
    og.left.add("a")
    assert og.live(gp, 1_000, 20_000, "b") == {"b"}  # even with a long poll parked
    assert og.live(gp, 1_000, 20_000, "a") == {"a", "b"}  # its own pull
