"""Group decisions, epochs and the leader lease in the meta store, on SQLite, PostgreSQL and
MariaDB: a decision is written only over the row it was made from, promotions are kept as
epochs, and exactly one meta server holds the lease."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

import pytest
from meta_databases import fresh_database

from qmq.meta.leader import Holder, LeaderLease
from qmq.meta.schema import EPOCHS_KEPT
from qmq.meta.store import GroupRecord, MetaStore, ServerRecord


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as db:
        yield db.url


@pytest.fixture
def store(db_url: str) -> Iterator[MetaStore]:
    s = MetaStore(db_url)
    yield s
    s.close()


FIRST = GroupRecord("broker", "b1", 1, "h:1", None, None, 1_000, "meta-a")


def _promoted(before: GroupRecord, master: str, offsets: tuple[int, int], by: str = "meta-a") -> GroupRecord:
    return replace(
        before,
        epoch=before.epoch + 1,
        master=master,
        message_offset=offsets[0],
        action_offset=offsets[1],
        changed_at_ms=before.changed_at_ms + 1,
        changed_by=by,
    )


def test_the_first_group_row_stands_and_a_later_create_returns_it(store: MetaStore) -> None:
    assert store.group("broker", "b1") is None
    assert store.create_group(FIRST) == FIRST
    assert store.create_group(replace(FIRST, master="h:2", changed_by="meta-b")) == FIRST
    assert store.groups() == [FIRST]
    assert store.group("delay", "b1") is None  # a delay group of the same name is another group


def test_a_decision_is_written_only_over_the_row_it_was_made_from(store: MetaStore) -> None:
    store.create_group(FIRST)
    second = _promoted(FIRST, "h:2", (500, 70))
    assert store.change_group(FIRST, second) is True
    # Another meta server deciding from the same (now old) row loses, and writes nothing.
    assert store.change_group(FIRST, _promoted(FIRST, "h:3", (400, 60), by="meta-b")) is False
    assert store.group("broker", "b1") == second
    assert store.offsets_after("broker", "b1", 1) == (500, 70)
    assert store.offsets_after("broker", "b1", 2) is None
    third = _promoted(second, "h:1", (800, 80))
    assert store.change_group(second, third) is True
    assert store.offsets_after("broker", "b1", 1) == (500, 70)
    assert store.offsets_after("broker", "b1", 2) == (800, 80)


def test_only_the_latest_epochs_are_kept_and_an_older_one_is_cut_no_later_than_it_began(
    store: MetaStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    import qmq.meta.store as store_module

    monkeypatch.setattr(store_module, "EPOCHS_KEPT", 2)
    assert EPOCHS_KEPT > 2
    group = store.create_group(FIRST)
    for i, offsets in enumerate([(500, 70), (300, 90), (800, 80)]):
        after = _promoted(group, f"h:{i + 2}", offsets)
        assert store.change_group(group, after)
        group = after
    # Epoch 2's row is gone: a server from epoch 1 is cut at the smallest offsets kept.
    assert store.offsets_after("broker", "b1", 1) == (300, 80)
    assert store.offsets_after("broker", "b1", 2) == (300, 90)


def test_exactly_one_of_two_meta_servers_holds_the_lease(store: MetaStore, db_url: str) -> None:
    other_store = MetaStore(db_url)
    try:
        a = LeaderLease(store, "meta-a", "http://a", lease_ms=1_000)
        b = LeaderLease(other_store, "meta-b", "http://b", lease_ms=1_000)
        assert b.holder() is None
        assert a.acquire(10_000) is True
        assert b.acquire(10_000) is False
        assert a.acquire(10_500) is True  # renewed
        assert b.acquire(11_400) is False
        assert b.holder() == Holder("meta-a", "http://a", 11_500)
        assert (a.leads(11_499), a.leads(11_500)) == (True, False)
        # a stops renewing: once its lease ran out, b takes it and a cannot take it back.
        assert b.acquire(11_501) is True
        assert a.acquire(11_502) is False
        assert a.leads(11_502) is False
        # b gives it up: a takes it at once.
        b.release()
        assert a.acquire(11_503) is True
    finally:
        other_store.close()


def test_meta_servers_racing_for_the_first_lease_get_one_leader(store: MetaStore, db_url: str) -> None:
    stores = [MetaStore(db_url) for _ in range(4)]
    try:
        leases = [LeaderLease(s, f"meta-{i}", f"http://{i}", lease_ms=60_000) for i, s in enumerate(stores)]
        with ThreadPoolExecutor(len(leases)) as pool:
            won = list(pool.map(lambda lease: lease.acquire(1_000), leases))
        assert sum(won) == 1
        holder = LeaderLease(store, "x", "http://x", 1).holder()
        assert holder is not None
        assert holder.owner == f"meta-{won.index(True)}"
    finally:
        for s in stores:
            s.close()


def test_silent_servers_are_forgotten_but_never_a_groups_master(store: MetaStore) -> None:
    def server(address: str, last_heartbeat_ms: int, group: str = "b1") -> ServerRecord:
        return ServerRecord("broker", group, address, "h:9", 1, "slave", 0, last_heartbeat_ms)

    store.create_group(FIRST)  # master h:1
    for record in (server("h:1", 10), server("h:2", 10), server("h:3", 500), server("h:1", 10, group="b2")):
        store.save_server(record)
    assert store.forget_servers(100) == 2
    assert [(s.group, s.address) for s in store.servers()] == [("b1", "h:1"), ("b1", "h:3")]
