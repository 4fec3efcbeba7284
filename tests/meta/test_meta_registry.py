"""The registry's logic with a hand-moved clock: heartbeats and group states, which server
stands for a group, and how subjects are routed, balanced, persisted and widened."""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa

from qmq.common.clock import ManualClock
from qmq.meta import registry as registry_module
from qmq.meta.registry import GroupView, Registration, Registry, RegistryFullError
from qmq.meta.store import MetaStore, sqlite_url

TIMEOUT_MS = 30_000


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


def _registry(store: MetaStore, clock: ManualClock, route_groups: int = 2) -> Registry:
    return Registry(store, clock, heartbeat_timeout_ms=TIMEOUT_MS, route_groups=route_groups)


def _broker(group: str, port: int, *, pid: int = 100, role_in_group: str = "master") -> Registration:
    return Registration(
        role="broker",
        group=group,
        address=f"127.0.0.1:{port}",
        http=f"127.0.0.1:{port + 1000}",
        pid=pid,
        role_in_group=role_in_group,  # type: ignore[arg-type]
    )


def _states(reg: Registry) -> dict[str, str]:
    return {g.group: g.state for g in reg.groups("broker")}


def test_first_report_registers_later_ones_are_heartbeats_and_a_new_pid_registers_again(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    assert reg.register(_broker("b1", 20881, pid=100)).is_new is True
    first_ms = clock.now_ms()
    clock.advance(5)
    assert reg.register(_broker("b1", 20881, pid=100)).is_new is False
    [row] = store.servers()
    assert (row.registered_at_ms, row.last_heartbeat_ms) == (first_ms, first_ms + 5_000)

    clock.advance(5)
    assert reg.register(_broker("b1", 20881, pid=101)).is_new is True
    [row] = store.servers()
    assert (row.pid, row.registered_at_ms, row.last_heartbeat_ms) == (
        101,
        first_ms + 10_000,
        first_ms + 10_000,
    )


def test_a_group_is_unavailable_once_its_master_is_silent_past_the_timeout(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    reg.register(_broker("b2", 20891))
    assert reg.groups("broker") == [
        GroupView(role="broker", group="b1", address="127.0.0.1:20881", http="127.0.0.1:21881", state="available"),
        GroupView(role="broker", group="b2", address="127.0.0.1:20891", http="127.0.0.1:21891", state="available"),
    ]

    clock.advance(TIMEOUT_MS / 1000)
    reg.register(_broker("b2", 20891))
    assert _states(reg) == {"b1": "available", "b2": "available"}  # exactly the timeout: still in time

    clock.advance(0.001)
    assert _states(reg) == {"b1": "unavailable", "b2": "available"}

    reg.register(_broker("b1", 20881))
    assert _states(reg) == {"b1": "available", "b2": "available"}
    assert reg.groups("delay") == []


def test_a_group_is_shown_by_its_latest_master_and_never_by_a_slave(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    reg.register(_broker("b1", 20882, role_in_group="slave"))
    reg.register(_broker("lonely", 20883, role_in_group="slave"))
    assert [(g.group, g.address) for g in reg.groups("broker")] == [("b1", "127.0.0.1:20881")]

    # The master dies; the slave is promoted and reports as master.
    clock.advance(60)
    reg.register(_broker("b1", 20882, role_in_group="master"))
    [group] = reg.groups("broker")
    assert (group.address, group.state) == ("127.0.0.1:20882", "available")


def test_routing_picks_the_configured_number_of_groups_and_balances_subjects(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock, route_groups=2)
    for i, group in enumerate(("b1", "b2", "b3")):
        reg.register(_broker(group, 20881 + 10 * i))

    routes = reg.routes(["s1", "s2", "s3"])
    # Fewest subjects first, ties by name.
    assert routes == {"s1": ["b1", "b2"], "s2": ["b1", "b3"], "s3": ["b2", "b3"]}
    assert Counter(g for gs in routes.values() for g in gs) == {"b1": 2, "b2": 2, "b3": 2}

    # Asking again returns the same routes and routes nothing anew.
    assert reg.routes(["s3", "s1"]) == {"s3": ["b2", "b3"], "s1": ["b1", "b2"]}
    assert store.routes() == routes

    many = reg.routes([f"t{i}" for i in range(30)])
    load = Counter(g for gs in [*routes.values(), *many.values()] for g in gs)
    assert max(load.values()) - min(load.values()) <= 1


def test_routes_skip_unavailable_groups_and_are_kept_across_restarts(
    store_url: str, store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    reg.register(_broker("b2", 20891))
    clock.advance(TIMEOUT_MS / 1000 + 1)
    reg.register(_broker("b3", 20901))
    reg.register(_broker("b4", 20911))
    assert reg.routes(["s"]) == {"s": ["b3", "b4"]}

    # A new registry over the same database, at a time when every group is silent: the
    # subject keeps its groups; nothing is re-picked.
    clock.advance(TIMEOUT_MS)
    reopened = MetaStore(store_url)
    try:
        again = _registry(reopened, clock)
        clock.advance(TIMEOUT_MS / 1000)  # past its first timeout, in which it counts nobody silent
        assert set(_states(again).values()) == {"unavailable"}
        assert again.routes(["s"]) == {"s": ["b3", "b4"]}
    finally:
        reopened.close()


def test_a_subject_short_of_groups_gains_more_as_they_appear_and_never_loses_one(
    store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock, route_groups=2)
    assert reg.routes(["s"]) == {"s": []}  # no broker group yet: nothing routed, nothing stored
    assert store.routes() == {}

    reg.register(_broker("b2", 20881))
    assert reg.routes(["s"]) == {"s": ["b2"]}
    reg.register(_broker("b1", 20891))
    assert reg.routes(["s"]) == {"s": ["b1", "b2"]}
    reg.register(_broker("b0", 20901))
    assert reg.routes(["s"]) == {"s": ["b1", "b2"]}  # already at route_groups

    clock.advance(TIMEOUT_MS / 1000 + 1)
    reg.register(_broker("b0", 20901))
    assert reg.routes(["s"]) == {"s": ["b1", "b2"]}  # silent groups keep their routes
    assert store.routes() == {"s": ["b1", "b2"]}


class CountingStore(MetaStore):
    """A real store that counts its transactions by what they do."""

    def __init__(self, url: str) -> None:
        self.transactions: Counter[str] = Counter()
        super().__init__(url)

    @contextlib.contextmanager
    def transaction(self, what: str) -> Iterator[sa.Connection]:
        self.transactions[what] += 1
        with super().transaction(what) as conn:
            yield conn


def test_a_request_of_many_new_subjects_is_one_read_and_one_write_and_full_routes_are_not_read_again(
    store_url: str, clock: ManualClock
) -> None:
    counting = CountingStore(store_url)
    try:
        reg = _registry(counting, clock, route_groups=2)
        reg.register(_broker("b1", 20881))
        counting.transactions.clear()
        subjects = [f"s{i}" for i in range(256)]
        assert reg.routes(subjects) == {s: ["b1"] for s in subjects}
        assert counting.transactions == {"read routes": 1, "save routes": 1}
        assert len(counting.routes()) == 256

        # Every route holds every available group: no other meta server can have widened one,
        # so the refreshes of clients (every subject, every 2 s) read nothing.
        counting.transactions.clear()
        clock.advance(5)
        assert reg.routes(subjects) == {s: ["b1"] for s in subjects}
        assert not {what for what in counting.transactions if "route" in what}

        # A second group appears: the routes are read again (once), then widened in one write.
        reg.register(_broker("b2", 20891))
        counting.transactions.clear()
        assert reg.routes(subjects) == {s: ["b1", "b2"] for s in subjects}
        assert {w: n for w, n in counting.transactions.items() if "route" in w} == {"read routes": 1, "save routes": 1}
    finally:
        counting.close()


def test_delay_groups_are_listed_but_never_routed_to(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    reg.register(Registration(role="delay", group="d1", address="127.0.0.1:30881", http="127.0.0.1:31881", pid=7))
    assert [g.group for g in reg.groups("delay")] == ["d1"]
    assert reg.routes(["s"]) == {"s": []}


def test_a_route_made_by_another_meta_server_sharing_the_store_is_used(
    store_url: str, store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    reg.register(_broker("b2", 20891))
    other = MetaStore(store_url)
    try:
        other.add_routes("s", ["b2"], clock.now_ms())
    finally:
        other.close()
    assert reg.routes(["s"]) == {"s": ["b1", "b2"]}


def test_the_routes_version_changes_when_a_route_answered_before_changes_not_when_one_is_made(
    store_url: str, store: MetaStore, clock: ManualClock
) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    first = reg.routes_version()
    reg.routes([f"s{i}" for i in range(10)])
    assert reg.routes_version() == first  # new subjects: clients asked for them, nobody holds them
    assert reg.routes([f"s{i}" for i in range(10)]) == {f"s{i}": ["b1"] for i in range(10)}
    assert reg.routes_version() == first

    reg.register(_broker("b2", 20891))
    reg.routes(["s0"])  # widened to b2
    widened = reg.routes_version()
    assert widened != first

    # Another meta server sharing the store widens s1: seen here when the routes are read again.
    other_store = MetaStore(store_url)
    try:
        Registry(other_store, clock, heartbeat_timeout_ms=TIMEOUT_MS, route_groups=2).routes(["s1"])
    finally:
        other_store.close()
    assert reg.routes_version() == widened
    reg.reload_routes()
    assert reg.routes(["s1"]) == {"s1": ["b1", "b2"]}
    reloaded = reg.routes_version()
    assert reloaded != widened
    reg.reload_routes()
    assert reg.routes_version() == reloaded  # nothing changed

    # A registry of its own (a restarted meta server) has another version whatever it holds.
    assert _registry(store, clock).routes_version() != reloaded


def test_counts_report_groups_by_role_and_state_and_routes(store: MetaStore, clock: ManualClock) -> None:
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))
    clock.advance(TIMEOUT_MS / 1000 + 1)
    reg.register(_broker("b2", 20891))
    reg.routes(["s1", "s2"])
    counts = reg.counts()
    assert counts.groups == {
        ("broker", "available"): 1,
        ("broker", "unavailable"): 1,
        ("delay", "available"): 0,
        ("delay", "unavailable"): 0,
    }
    assert (counts.subjects, counts.routes) == (2, 2)


def test_the_number_of_servers_and_subjects_is_bounded(
    store: MetaStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(registry_module, "SERVERS_MAX", 2)
    monkeypatch.setattr(registry_module, "SUBJECTS_MAX", 1)
    reg = _registry(store, clock, route_groups=1)
    reg.register(_broker("b1", 20881))
    reg.register(_broker("b2", 20891))
    with pytest.raises(RegistryFullError, match="already holds 2 servers"):
        reg.register(_broker("b3", 20901))
    reg.register(_broker("b2", 20891))  # heartbeats of known servers still count

    assert reg.routes(["s1"]) == {"s1": ["b1"]}
    with pytest.raises(RegistryFullError, match="cannot route 's2'"):
        reg.routes(["s2"])
    assert reg.routes(["s1"]) == {"s1": ["b1"]}


def test_a_full_registry_forgets_servers_long_silent_to_take_a_new_one(
    store: MetaStore, clock: ManualClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Found by the fault campaign (chaos/, hostile clients): registrations posted once (mutated
    # bodies to /meta/register) each held a slot for SERVER_FORGET_MS (24 h); SERVERS_MAX of them
    # kept every new server out that long.
    monkeypatch.setattr(registry_module, "SERVERS_MAX", 3)
    reg = _registry(store, clock)
    reg.register(_broker("b1", 20881))  # a group's master: never forgotten to make room
    reg.register(_broker("fz", 1, role_in_group="slave"))  # posted once, never again
    reg.register(_broker("fz", 2, role_in_group="slave"))
    clock.advance(10 * TIMEOUT_MS / 1000 - 1)  # not silent long enough yet
    with pytest.raises(RegistryFullError, match="none of them silent long enough"):
        reg.register(_broker("b2", 20891))
    reg.register(_broker("fz", 2, role_in_group="slave"))  # this one heartbeats again
    clock.advance(2)
    assert reg.register(_broker("b2", 20891)).is_new  # room made: fz's silent slave is forgotten
    assert {s.address for s in reg.servers()} == {"127.0.0.1:20881", "127.0.0.1:2", "127.0.0.1:20891"}


def test_bad_settings_are_refused(store: MetaStore, clock: ManualClock) -> None:
    with pytest.raises(ValueError, match="heartbeat_timeout_ms must be positive, got 0"):
        Registry(store, clock, heartbeat_timeout_ms=0, route_groups=2)
    with pytest.raises(ValueError, match="route_groups must be positive, got 0"):
        Registry(store, clock, heartbeat_timeout_ms=1, route_groups=0)


def test_a_registry_just_started_counts_nobody_silent_for_the_time_the_meta_server_was_away(
    store: MetaStore, clock: ManualClock
) -> None:
    before = _registry(store, clock)
    before.register(_broker("b1", 20881))
    clock.advance(TIMEOUT_MS / 1000 + 1)
    before.register(_broker("b2", 20891))
    clock.advance(100)  # the meta server was away, far past the timeout

    restarted = _registry(store, clock)
    # b2 was heard last, just before the meta server went away; b1 was silent past the timeout by then.
    assert _states(restarted) == {"b1": "unavailable", "b2": "available"}
    clock.advance(5)
    assert _states(restarted) == {"b1": "unavailable", "b2": "available"}  # b2 not silent yet: the grace
    restarted.register(_broker("b1", 20881))
    assert _states(restarted) == {"b1": "available", "b2": "available"}
    assert restarted.check_promotions() == []
    clock.advance(TIMEOUT_MS / 1000)  # the grace is over: real time again, and b2 said nothing
    assert _states(restarted) == {"b1": "available", "b2": "unavailable"}
