"""Push subscriptions and their leases in the meta store on SQLite, PostgreSQL and MariaDB: rows
round-trip, a subscription is held by one owner at a time even when two meta stores on one
database hand leases out at once, leases are shared out among the gateways asking, and an
expired or released lease is taken over."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from meta_databases import fresh_database

from qmq.meta.push_store import PushExistsError, PushRow, PushStore, fair_share
from qmq.meta.store import MetaStore
from qmq.protocol.push import PushSubscription


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as db:
        yield db.url


def _sub(group: str = "billing", **changes: object) -> PushSubscription:
    values: dict[str, object] = {
        "subject": "Orders",
        "group": group,
        "url": "https://hooks.example/q?x=1",
        "concurrency": 4,
        "rate_per_s": 50,
        "timeout_ms": 2_500,
        "secret": "k\u00e9y",
        "tags": ("a", "b"),
        "tag_type": "and",
        "start_from": "earliest",
        "max_retries": 3,
        "retry_backoff_ms": (100, 2_000),
        "created_at_ms": 1_700_000_000_123,
        **changes,
    }
    return PushSubscription(**values)  # type: ignore[arg-type]


def test_a_subscription_round_trips_and_is_unique_per_subject_and_group(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        push = PushStore(store)
        push.add(_sub())
        push.add(_sub(subject="orders"))  # names are exact: another subject
        with pytest.raises(PushExistsError, match="exists already"):
            push.add(_sub(url="http://other/"))
        rows = push.rows()
        assert [r.subscription for r in rows] == [_sub(), _sub(subject="orders")]
        assert {(r.owner, r.lease_expires_ms, r.lease_generation) for r in rows} == {("", 0, 0)}
        assert push.remove("Orders", "billing")
        assert not push.remove("Orders", "billing")
        assert [r.subscription.subject for r in push.rows()] == ["orders"]
    finally:
        store.close()


def test_leases_go_to_one_owner_at_a_time_shared_out_among_the_gateways(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        push = PushStore(store)
        for group in ("g1", "g2", "g3"):
            push.add(_sub(group))

        def groups(rows: list[PushRow]) -> list[str]:
            return [r.subscription.group for r in rows]

        a = push.lease("gw-a", "http://a", 1_000, 5_000, 10)
        assert groups(a) == ["g1", "g2", "g3"]  # the only gateway: all of them
        assert {(r.owner, r.owner_url, r.lease_expires_ms, r.lease_generation) for r in a} == {
            ("gw-a", "http://a", 6_000, 1)
        }
        assert push.lease("gw-b", "http://b", 2_000, 5_000, 10) == []  # all held; its share is 2 now
        a = push.lease("gw-a", "http://a", 3_000, 5_000, 10)
        assert groups(a) == ["g1", "g2"]  # gave g3 up: its share of 3 among 2 is 2
        assert [r.lease_expires_ms for r in a] == [8_000, 8_000]
        b = push.lease("gw-b", "http://b", 3_500, 5_000, 10)
        assert [(r.subscription.group, r.lease_generation) for r in b] == [("g3", 2)]

        # A stops asking: once its leases ran out (8 000) and it counts as gone, B takes all
        assert groups(push.lease("gw-b", "http://b", 8_000, 5_000, 10)) == ["g3"]
        b = push.lease("gw-b", "http://b", 8_001, 5_000, 10)
        assert [(r.subscription.group, r.lease_generation) for r in b] == [("g1", 2), ("g2", 2), ("g3", 2)]
        assert push.lease("gw-a", "http://a", 8_002, 5_000, 10) == []  # A learns it lost them

        assert push.release("gw-b") == 3
        assert groups(push.lease("gw-a", "http://a", 8_003, 5_000, 10)) == ["g1", "g2", "g3"]
        assert groups(push.lease("gw-a", "http://a", 8_004, 5_000, 2)) == ["g1", "g2"]  # held_max
    finally:
        store.close()


def test_two_meta_stores_racing_hand_each_subscription_to_one_owner(db_url: str) -> None:
    first, second = MetaStore(db_url), MetaStore(db_url)
    try:
        for group in range(20):
            PushStore(first).add(_sub(f"g{group}"))
        held: dict[str, list[str]] = {}
        start = threading.Barrier(2)

        def take(store: MetaStore, owner: str) -> None:
            push = PushStore(store)
            start.wait()
            held[owner] = [r.subscription.group for r in push.lease(owner, "", 1_000, 5_000, 100)]

        threads = [
            threading.Thread(target=take, args=(first, "gw-a")),
            threading.Thread(target=take, args=(second, "gw-b")),
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert not set(held["gw-a"]) & set(held["gw-b"])
        # asking in turn shares out what the race left: the one holding more gives the excess up
        for store, owner in ((first, "gw-a"), (second, "gw-b")) * 2:
            held[owner] = [r.subscription.group for r in PushStore(store).lease(owner, "", 1_001, 5_000, 100)]
        assert not set(held["gw-a"]) & set(held["gw-b"])
        assert sorted(held["gw-a"] + held["gw-b"]) == sorted(f"g{g}" for g in range(20))
        assert len(held["gw-a"]) == len(held["gw-b"]) == 10
        owners = {r.subscription.group: r.owner for r in PushStore(first).rows()}
        assert all(owners[g] == "gw-a" for g in held["gw-a"])
        assert all(owners[g] == "gw-b" for g in held["gw-b"])
    finally:
        first.close()
        second.close()


@pytest.mark.parametrize(
    ("capacities", "total", "share"),
    [
        ([100, 100], 10, 5),
        ([100, 100, 100], 10, 4),
        ([1, 100], 10, 9),  # one runs at most 1: the other runs the rest
        ([0, 100], 10, 10),
        ([2, 3], 10, 3),  # not enough room: each runs all it may
        ([100], 0, 0),
    ],
)
def test_fair_share_lets_the_gateways_run_every_subscription_together(
    capacities: list[int], total: int, share: int
) -> None:
    assert fair_share(capacities, total) == share


def test_a_gateway_that_runs_few_leaves_the_rest_to_the_others(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        push = PushStore(store)
        for group in range(10):
            push.add(_sub(f"g{group}"))
        assert len(push.lease("gw-small", "", 1_000, 5_000, 1)) == 1
        assert len(push.lease("gw-big", "", 1_001, 5_000, 100)) == 9
        assert len(push.lease("gw-small", "", 1_002, 5_000, 1)) == 1
    finally:
        store.close()
