"""Pull-log positions are never handed out twice: after a restart (a power loss under flush =
"periodic" may have undone pulls that were answered) or a promotion, pull logs go on in a new
stretch, so an ack of a pull that was undone acknowledges nothing instead of other messages, and
the broker can tell the consumer so (``Progress.unheld``)."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from test_store_send_pull import records

from conftest import append, batch, flush
from qmq.store.action_log import PULL, apply_action
from qmq.store.broker_store import BrokerStore
from qmq.store.progress import SKIPPED_KEPT_MAX, STRETCH_BITS, Progress


def _action_log_bytes(tmp_path: Path) -> tuple[Path, int]:
    segment = next((tmp_path / "broker" / "action").glob("*.act"))
    return segment, segment.stat().st_size


def test_an_ack_of_a_pull_a_power_loss_undid_acknowledges_nothing_the_next_pulls_hand_out(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store(flush="periodic")
    append(store, batch("s", [f"m{i}" for i in range(10)]))
    gp = store.group("s", "g", "earliest")
    flush(store)
    segment, durable_bytes = _action_log_bytes(tmp_path)
    handed = store.pull(gp, gp.consumer("a"), "a-1", 5)  # answered to consumer a: m0..m4 at 0..4
    assert handed is not None
    assert handed.runs == [[0, 5]]
    store.close()
    with open(segment, "r+b") as f:  # the power goes before the periodic fsync: the pull is undone
        os.ftruncate(f.fileno(), durable_bytes)

    store = open_store(flush="periodic")
    gp = store.progress.get("s", "g")
    assert gp is not None
    b_got = store.pull(gp, gp.consumer("b"), "b-1", 5)  # b is first after the restart: m0..m4
    assert b_got is not None
    assert [m for _s, m in records(b_got)] == [f"m{i}" for i in range(5)]
    cp = gp.consumer("a")
    a_got = store.pull(gp, cp, "a-2", 5)  # a reconnects: m5..m9, not at the positions it was handed m0..m4
    assert a_got is not None
    assert [m for _s, m in records(a_got)] == [f"m{i}" for i in range(5, 10)]
    assert Progress.unheld(cp, [[0, 5]]) == 5  # the broker tells a its ack took nothing
    store.ack(gp, cp, [[0, 5]])  # a's ack of m0..m4, sent before the power went
    assert cp.unacked == 5  # m5..m9 are still a's to handle
    first = a_got.runs[0][0]
    assert Progress.unheld(cp, [[first, first + 5]]) == 0
    assert a_got.runs[0][0] >= 1 << STRETCH_BITS

    # a dies before handling m5..m9: they are handed out again, not lost to the group
    again = store.pull(gp, cp, "a-3", 10)
    assert again is not None
    assert [m for _s, m in records(again)] == [f"m{i}" for i in range(5, 10)]
    assert again.runs == a_got.runs

    # the stretch is in the action log: a restart (or a slave) replays the same positions
    store.ack(gp, cp, [[again.runs[0][0], again.runs[0][0] + 2]])
    flush(store)
    store.close()
    store = open_store(flush="periodic")
    gp = store.progress.get("s", "g")
    assert gp is not None
    cp = gp.consumers["a"]
    assert cp.ack_offset == a_got.runs[0][0] + 2
    assert cp.unacked == 3
    rest = store.pull(gp, cp, "a-4", 10)
    assert rest is not None
    assert [m for _s, m in records(rest)] == ["m7", "m8", "m9"]
    assert rest.runs == [[a_got.runs[0][0] + 2, 3]]


def test_a_first_start_hands_out_positions_from_zero(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["a", "b"]))
    gp = store.group("s", "g", "earliest")
    got = store.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert got.runs == [[0, 2]]


def test_a_promoted_slave_goes_on_above_what_its_old_master_may_have_handed_out(
    open_store: Callable[..., BrokerStore],
) -> None:
    store = open_store()  # a slave: it applies its master's actions, the last pull it never got
    append(store, batch("s", [f"m{i}" for i in range(6)]))
    gp = store.group("s", "g", "earliest")
    master = Progress()
    master_stretch = master.next_stretch(1_795_000_000_000)
    apply_action(store.progress, [PULL, "s", "g", "c", master_stretch, [[0, 2]], 2, 0])
    cp = gp.consumers["c"]
    assert (cp.pull_log_end, cp.ack_offset) == (master_stretch + 2, master_stretch)
    # the master handed out [master_stretch + 2, + 4) and was cut off; this slave is promoted
    store.new_stretch()
    got = store.pull(gp, cp, "y", 4)  # what it never acked again, then the next two
    assert got is not None
    assert got.runs[0] == [master_stretch, 2]
    assert got.runs[1][0] > master_stretch + 4
    lost = [[master_stretch + 2, master_stretch + 4]]
    assert Progress.unheld(cp, lost) == 2
    store.ack(gp, cp, lost)  # the consumer's ack of what it lost
    assert cp.unacked == 4  # m0, m1 (never acked) and the two just handed out
    assert Progress.unheld(cp, [[master_stretch, master_stretch + 2]]) == 0  # replicated: held


def test_skipping_to_a_stretch_counts_the_positions_between_as_acknowledged() -> None:
    progress = Progress()
    gp = progress.create_group("s", "g", 0)
    cp = gp.consumer("c")
    Progress.record_pull(gp, cp, [[0, 3]], 3)
    Progress.apply_ack(cp, [[1, 2]])
    assert Progress.record_pull(gp, cp, [[3, 2]], 5, start=100) == 100
    assert (cp.pull_log_end, cp.ack_offset, cp.acked, cp.unacked) == (102, 0, [[1, 2], [3, 100]], 4)
    Progress.apply_ack(cp, [[0, 1], [2, 3]])
    assert (cp.ack_offset, cp.acked, list(cp.runs)) == (100, [], [[100, 3, 2]])
    assert Progress.record_pull(gp, cp, [[5, 1]], 6, start=50) == 102  # a start behind the end: none skipped


def test_unheld_counts_positions_past_the_pull_log_and_in_the_stretches_skipped() -> None:
    progress = Progress()
    gp = progress.create_group("s", "g", 0)
    cp = gp.consumer("c")
    Progress.record_pull(gp, cp, [[0, 3]], 3)  # positions 0..2
    assert Progress.unheld(cp, [[0, 3]]) == 0
    assert Progress.unheld(cp, [[2, 6]]) == 3  # 3..5: a pull this broker never had (past the end)
    Progress.record_pull(gp, cp, [[3, 2]], 5, start=100)  # 3..99 skipped, 100..101 handed out
    assert Progress.unheld(cp, [[1, 4], [99, 102]]) == 2  # 3 and 99; 1, 2, 100, 101 are held
    Progress.apply_ack(cp, [[0, 102]])
    assert Progress.unheld(cp, [[0, 3]]) == 0  # acknowledged again: held, a repeat is harmless
    assert Progress.unheld(cp, [[50, 60]]) == 10  # still skipped, though counted as acknowledged
    for n in range(SKIPPED_KEPT_MAX):  # only the last SKIPPED_KEPT_MAX stretches are kept
        Progress.record_pull(gp, cp, [[5 + n, 1]], 6 + n, start=1000 * (n + 1))
    assert cp.skipped is not None
    assert len(cp.skipped) == SKIPPED_KEPT_MAX
    assert Progress.unheld(cp, [[50, 60]]) == 0
    assert Progress.unheld(cp, [[500, 510]]) == 10
