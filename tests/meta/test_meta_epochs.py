"""What the registry decides about a group's master and epoch, with a hand-moved clock: the first
master, a slave waiting for one, automatic promotion only when a fresh slave exists, an old
master told to cut its logs and follow, promotion by hand and its refusal, and epochs kept
across a restart of the meta server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from qmq.common.clock import ManualClock
from qmq.meta.registry import (
    SERVER_FORGET_MS,
    Heartbeat,
    PromotionRefusedError,
    Registration,
    Registry,
    UnknownGroupError,
)
from qmq.meta.store import MetaStore, sqlite_url

TIMEOUT_MS = 30_000
STEP_S = 10.0  # one heartbeat period


@pytest.fixture
def store_url(tmp_path: Path) -> str:
    return sqlite_url(tmp_path / "meta")


@pytest.fixture
def store(store_url: str) -> Iterator[MetaStore]:
    s = MetaStore(store_url)
    yield s
    s.close()


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


def _registry(store: MetaStore, clock: ManualClock) -> Registry:
    return Registry(store, clock, heartbeat_timeout_ms=TIMEOUT_MS, route_groups=2, owner="meta-a")


def _report(port: int, role_in_group: str = "master", group: str = "b1", **changes: Any) -> Registration:
    values: dict[str, Any] = {
        "role": "broker",
        "group": group,
        "address": f"127.0.0.1:{port}",
        "http": f"127.0.0.1:{port + 1000}",
        "pid": port,
        "role_in_group": role_in_group,
        "epoch": 0,
    }
    values.update(changes)
    return Registration(**values)


M, S, S2 = 20881, 20882, 20883
ADDR = {M: "127.0.0.1:20881", S: "127.0.0.1:20882", S2: "127.0.0.1:20883"}


def _pair(reg: Registry, clock: ManualClock) -> None:
    """b1: master M in epoch 1 with slave S replicating, both having reported twice."""
    assert reg.register(_report(M)).answer == Heartbeat("master", 1, None, 0, None)
    assert reg.register(_report(S, "slave")).answer == Heartbeat("slave", 1, ADDR[M], 1, None)
    clock.advance(STEP_S)
    now = clock.now_ms()
    # a master is told which slaves heartbeat: only their REPLICATE requests count
    master_answer = Heartbeat("master", 1, None, 1, None, (ADDR[S],))
    assert reg.register(_report(M, epoch=1, log_end=500, action_end=70)).answer == master_answer
    reg.register(_report(S, "slave", epoch=1, log_end=500, action_end=70, replicated_ms=now))


def _master_of(reg: Registry, group: str = "b1") -> tuple[str, str]:
    [view] = [g for g in reg.groups("broker") if g.group == group]
    return view.address, view.state


def test_the_first_master_starts_epoch_1_and_a_slave_follows_it(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    [group] = store.groups()
    assert (group.epoch, group.master, group.message_offset, group.changed_by) == (1, ADDR[M], None, "meta-a")
    assert _master_of(reg) == (ADDR[M], "available")


def test_a_slave_started_first_waits_for_a_master(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    assert reg.register(_report(S, "slave")).answer == Heartbeat("slave", 0, None, 0, None)
    assert reg.groups("broker") == []  # a group with only a waiting slave is not offered to clients
    assert store.groups() == []
    reg.register(_report(M))
    assert reg.register(_report(S, "slave")).answer == Heartbeat("slave", 1, ADDR[M], 1, None)


def test_a_silent_master_is_replaced_by_its_fresh_slave_after_the_timeout_only(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    died_ms = clock.now_ms()  # M falls silent; S keeps heartbeating, its replication stopped now
    for _ in range(3):
        clock.advance(STEP_S)
        reg.register(_report(S, "slave", epoch=1, log_end=520, action_end=71, replicated_ms=died_ms))
        assert reg.check_promotions() == []  # silent for 30 s at most: still in time
    clock.advance(0.001)
    [promotion] = reg.check_promotions()
    assert (promotion.group.epoch, promotion.group.master, promotion.previous_master) == (2, ADDR[S], ADDR[M])
    assert (promotion.group.message_offset, promotion.group.action_offset) == (520, 71)
    assert not promotion.manual
    assert reg.check_promotions() == []  # done once

    # The slave learns it is master from its next heartbeat; clients see it at once.
    assert reg.register(_report(S, "slave", epoch=1, log_end=520)).answer == Heartbeat("master", 2, None, 0, None)
    assert _master_of(reg) == (ADDR[S], "available")


def test_the_old_master_is_told_to_cut_its_logs_where_the_new_epoch_began_and_follow(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    died_ms = clock.now_ms()
    clock.advance(STEP_S)
    reg.register(_report(S, "slave", epoch=1, log_end=520, action_end=71, replicated_ms=died_ms))
    clock.advance(TIMEOUT_MS / 1000)
    assert len(reg.check_promotions()) == 1

    back = reg.register(_report(M, "master", epoch=1, log_end=900, action_end=90)).answer
    assert back == Heartbeat("slave", 2, ADDR[S], 0, (520, 71))
    # Cut and following in the new epoch: nothing more to cut.
    assert reg.register(_report(M, "slave", epoch=2, log_end=520)).answer == Heartbeat("slave", 2, ADDR[S], 1, None)


def test_a_server_back_from_an_older_epoch_is_cut_where_the_epoch_after_its_own_began(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    reg.register(_report(S2, "slave", epoch=1, log_end=400, replicated_ms=clock.now_ms()))
    promotion = reg.promote("broker", "b1")  # epoch 2 at S, from (500, 70)
    assert promotion.manual
    assert promotion.group.epoch == 2
    clock.advance(STEP_S)
    now = clock.now_ms()
    reg.register(_report(S, "master", epoch=2, log_end=800, action_end=80))
    reg.register(_report(M, "slave", epoch=2, log_end=800, action_end=80, replicated_ms=now))
    assert reg.promote("broker", "b1").group.master == ADDR[M]  # epoch 3, from (800, 80)

    # S2 never heard of epochs 2 and 3: it cuts where epoch 2 began, not 3.
    answer = reg.register(_report(S2, "slave", epoch=1, log_end=600)).answer
    assert (answer.epoch, answer.master, answer.truncate) == (3, ADDR[M], (500, 70))
    # A server that never knew an epoch has written nothing under one: nothing to cut.
    assert reg.register(_report(20884, "slave", epoch=0)).answer.truncate is None


@pytest.mark.parametrize(
    ("slave", "why"),
    [
        ({"replicated_ms": 0}, "last held every write its master had answered never"),
        ({"replicated_ms": -1}, "answered 30.0 s before the master was last heard from"),
        ({"epoch": 0}, "reports epoch 0, the group is in epoch 1"),
        ({"epoch": None}, "reports no epoch"),
        ({"role_in_group": "master", "epoch": 0}, "reports itself master, not slave"),
    ],
)
def test_no_promotion_without_a_fresh_slave_and_promote_says_why(
    store: MetaStore, clock: ManualClock, slave: dict[str, Any], why: str
) -> None:
    reg = _registry(store, clock)
    reg.register(_report(M, epoch=1, log_end=500))
    if slave.get("replicated_ms") == -1:
        slave["replicated_ms"] = clock.now_ms() - TIMEOUT_MS - 1  # replicated before the limit
    fields: dict[str, Any] = {"role_in_group": "slave", "epoch": 1, "replicated_ms": clock.now_ms(), **slave}
    reg.register(_report(S, **fields))
    with pytest.raises(PromotionRefusedError, match=rf"broker group 'b1' has no fresh slave to promote .*{why}"):
        reg.promote("broker", "b1")
    clock.advance(TIMEOUT_MS / 1000 + 1)
    reg.register(_report(S, **fields))
    assert reg.check_promotions() == []
    assert _master_of(reg) == (ADDR[M], "unavailable")


def test_a_silent_slave_is_never_promoted(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    clock.advance(TIMEOUT_MS / 1000 + 1)
    assert reg.check_promotions() == []
    with pytest.raises(PromotionRefusedError, match=r"127.0.0.1:20882 \(pid 20882\) is silent for 31.0 s"):
        reg.promote("broker", "b1")


def test_the_slave_with_the_longest_log_is_promoted(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    reg.register(_report(S2, "slave", epoch=1, log_end=510, replicated_ms=clock.now_ms()))
    promotion = reg.promote("broker", "b1")
    assert (promotion.group.master, promotion.group.message_offset) == (ADDR[S2], 510)


def test_promoting_an_unknown_group_lists_the_known_ones(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    with pytest.raises(UnknownGroupError, match=r"no broker group 'b9' has registered.*broker groups: b1"):
        reg.promote("broker", "b9")
    with pytest.raises(UnknownGroupError, match=r"delay groups: none"):
        reg.promote("delay", "b1")


def test_epochs_and_masters_are_kept_across_a_restart_of_the_meta_server(
    store_url: str, store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    reg.promote("broker", "b1")
    reopened = MetaStore(store_url)
    try:
        again = _registry(reopened, clock)
        assert _master_of(again) == (ADDR[S], "available")
        answer = again.register(_report(M, epoch=1, log_end=900)).answer
        assert answer == Heartbeat("slave", 2, ADDR[S], 0, (500, 70))
    finally:
        reopened.close()


def test_a_master_restarted_at_another_address_keeps_its_group_in_its_epoch(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    moved = 20999
    assert reg.register(_report(moved, epoch=1, log_end=500)).answer.role_in_group == "master"
    assert _master_of(reg)[0] == "127.0.0.1:20999"
    assert store.groups()[0].epoch == 1
    # A fresh server claiming master without knowing the epoch does not take over.
    assert reg.register(_report(20998, epoch=0)).answer == Heartbeat("slave", 1, "127.0.0.1:20999", 1, None)


def test_a_master_reporting_a_later_epoch_than_the_store_is_believed(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    reg.register(_report(M, epoch=1))
    assert reg.register(_report(M, epoch=4)).answer.epoch == 4
    # ...and a group first seen through a master that remembers its epoch starts there.
    assert reg.register(_report(S2, group="b2", epoch=7)).answer.epoch == 7


def test_servers_that_do_not_report_epochs_keep_the_latest_master(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    reg.register(_report(M, epoch=None))
    assert reg.register(_report(S, epoch=None)).answer.role_in_group == "master"
    assert _master_of(reg)[0] == ADDR[S]


def test_a_database_from_before_epochs_gains_the_new_columns(tmp_path: Path, clock: ManualClock) -> None:
    url = sqlite_url(tmp_path / "old")
    engine = sa.create_engine(url)
    with engine.begin() as conn:
        conn.execute(
            sa.text(
                "CREATE TABLE qmq_meta_servers (role VARCHAR(16), group_name VARCHAR(100), address VARCHAR(300), "
                "http VARCHAR(300) NOT NULL, pid BIGINT NOT NULL, role_in_group VARCHAR(16) NOT NULL, "
                "registered_at_ms BIGINT NOT NULL, last_heartbeat_ms BIGINT NOT NULL, "
                "PRIMARY KEY (role, group_name, address))"
            )
        )
        conn.execute(sa.text("INSERT INTO qmq_meta_servers VALUES ('broker', 'b1', 'h:1', 'h:2', 7, 'master', 1, 2)"))
    engine.dispose()
    store = MetaStore(url)
    try:
        [row] = store.servers()
        assert (row.address, row.epoch, row.log_end, row.write_state) == ("h:1", None, 0, None)
        reg = _registry(store, clock)
        assert reg.register(_report(M, epoch=0)).answer.epoch == 1
    finally:
        store.close()


def test_servers_silent_for_a_day_are_forgotten_except_the_master(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    _pair(reg, clock)
    clock.advance(SERVER_FORGET_MS / 1000 + 1)
    assert reg.forget_silent() == 1
    assert [s.address for s in reg.servers()] == [ADDR[M]]
    assert _master_of(reg) == (ADDR[M], "unavailable")
