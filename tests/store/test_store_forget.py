"""Consumers gone with nothing unacknowledged are forgotten, and stay forgotten after a restart
(whether the checkpoint or the action log holds the forgetting)."""

from __future__ import annotations

from collections.abc import Callable

from test_store_recovery import checkpoint

from conftest import append, batch, flush
from qmq.common.clock import ManualClock
from qmq.store.action_log import FORGET, apply_action
from qmq.store.broker_store import BrokerStore
from qmq.store.progress import STRETCH_BITS, Progress

GONE_MS = 60_000


def test_only_silent_consumers_with_nothing_unacked_are_forgotten_and_a_restart_keeps_them_gone(
    open_store: Callable[..., BrokerStore], clock: ManualClock
) -> None:
    store = open_store()
    append(store, batch("s", [str(i) for i in range(10)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    for consumer_id, acked in (("done-1", True), ("done-2", True), ("busy", False), ("fresh", True)):
        cp = gp.consumer(consumer_id)
        cp.last_seen_ms = clock.now_ms()
        got = store.pull(gp, cp, "x", 2)
        assert got is not None
        if acked:
            store.ack(gp, cp, [[0, 2]])
    clock.advance(GONE_MS / 1000)
    gp.consumers["fresh"].last_seen_ms = clock.now_ms()  # it pulled again meanwhile
    assert store.forget_gone_consumers(clock.now_ms(), GONE_MS + 1) == 0  # not gone long enough
    assert store.forget_gone_consumers(clock.now_ms(), GONE_MS) == 2
    assert sorted(gp.consumers) == ["busy", "fresh"]
    checkpoint(store)  # done-1 and done-2 are out of the checkpoint
    gp.consumers["fresh"].last_seen_ms = 0
    assert store.forget_gone_consumers(clock.now_ms(), GONE_MS) == 1  # in the action log after it
    store.close()

    again = open_store()
    gp2 = again.progress.get("s", "g")
    assert gp2 is not None
    assert sorted(gp2.consumers) == ["busy"]
    assert gp2.pull_offset == 8
    # one that comes back starts a new pull log, from the group's offset, in the stretch of this
    # start (store/progress.py)
    back = gp2.consumer("done-1")
    got = again.pull(gp2, back, "y", 5)
    assert got is not None
    assert [count for _start, count in got.runs] == [2]
    assert got.runs[0][0] >= 1 << STRETCH_BITS


def test_replay_of_a_forget_drops_the_consumers_named() -> None:
    progress = Progress()
    gp = progress.create_group("s", "g", 0)
    for consumer_id in ("a", "b", "c"):
        gp.consumer(consumer_id)
    apply_action(progress, [FORGET, "s", "g", ["a", "c", "never-seen"]])
    assert list(gp.consumers) == ["b"]


def test_many_consumers_are_forgotten_in_actions_of_at_most_a_thousand(
    open_store: Callable[..., BrokerStore], clock: ManualClock
) -> None:
    store = open_store()
    gp = store.group("s", "g", "earliest")
    for i in range(2500):
        gp.consumer(f"restart-{i}").last_seen_ms = clock.now_ms()
    clock.advance(GONE_MS / 1000)
    start = store.alog.end
    assert store.forget_gone_consumers(clock.now_ms(), GONE_MS) == 2500
    actions = list(store.alog.replay(start, []))
    assert [(a[0], len(a[3])) for a in actions] == [(FORGET, 1000), (FORGET, 1000), (FORGET, 500)]
    assert gp.consumers == {}
