"""The rows of cluster operations on SQLite, PostgreSQL and MariaDB: group states, retired
routes, backlog reports, the history (the latest HISTORY_KEPT kept) and a group's removal."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from meta_databases import fresh_database

from qmq.meta import operations_schema
from qmq.meta.operations_store import Backlog, OperationsStore
from qmq.meta.store import GroupRecord, MetaStore, ServerRecord


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[MetaStore]:
    with fresh_database(request.param, tmp_path) as db:
        s = MetaStore(db.url)
        yield s
        s.close()


def test_operation_rows_are_kept_and_a_removed_group_leaves_only_its_tombstone(store: MetaStore) -> None:
    rows = OperationsStore(store)
    store.save_server(ServerRecord("broker", "b1", "h:1", "h:2", 7, "master", 1, 1, epoch=1))
    store.create_group(GroupRecord("broker", "b1", 1, "h:1", None, None, 1, "meta"))
    store.add_routes("Orders", ["b1", "b2"], 1)
    store.add_routes("orders", ["b1"], 1)  # names are exact: another subject

    rows.set_group_state("broker", "b1", "draining", 5, "ops@h")
    assert [(s.state, s.changed_by) for s in rows.group_states().values()] == [("draining", "ops@h")]
    rows.retire_route("Orders", "b1", 6, "ops@h")
    assert rows.route_removals() == {"Orders": {"b1"}}
    assert rows.routes_sharing("b1", 10) == {"Orders": ["b1", "b2"], "orders": ["b1"]}
    top = [("Orders", "billing", 3), ("orders", None, 1)]
    rows.save_backlog("broker", "b1", Backlog("h:1", 4, 2, top, True, 7))
    rows.save_backlog("broker", "b1", Backlog("h:1", 4, 2, top, True, 8))  # an update, not a second row
    assert rows.backlogs() == {("broker", "b1"): Backlog("h:1", 4, 2, top, True, 8)}
    assert rows.restore_route("Orders", "b1") is True
    assert rows.restore_route("Orders", "b1") is False

    rows.unregister_group("broker", "b1", 9, "ops@h")
    assert store.servers() == []
    assert store.groups() == []
    assert store.routes() == {"Orders": ["b2"]}
    assert rows.backlogs() == {}
    assert [(s.group, s.state) for s in rows.group_states().values()] == [("b1", "removed")]


def test_the_history_keeps_the_latest_entries_oldest_first(store: MetaStore, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("qmq.meta.operations_store.HISTORY_KEPT", 3)
    rows = OperationsStore(store)
    for i in range(5):
        rows.record(100 + i, f"ops{i}@h", "drain", f"b{i}", "x" * (operations_schema.DETAIL_CHARS + 10))
    entries = rows.history(10)
    assert [e.who for e in entries] == ["ops2@h", "ops3@h", "ops4@h"]
    assert all(len(e.detail) == operations_schema.DETAIL_CHARS for e in entries)
    assert [e.target for e in rows.history(2)] == ["b3", "b4"]
    assert rows.last_history_id() == entries[-1].id
