"""The meta store on SQLite, PostgreSQL and MariaDB: rows round-trip, routes only grow, and a
store that cannot be opened says why."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from meta_databases import fresh_database

from qmq.meta.store import MetaStore, MetaStoreError, ServerRecord, sqlite_url


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """An empty database of each kind, dropped after the test."""
    with fresh_database(request.param, tmp_path) as db:
        yield db.url


def _server(address: str = "127.0.0.1:20881", **changes: object) -> ServerRecord:
    values: dict[str, object] = {
        "role": "broker",
        "group": "broker-1",
        "address": address,
        "http": "127.0.0.1:8080",
        "pid": 4242,
        "role_in_group": "master",
        "registered_at_ms": 1_000,
        "last_heartbeat_ms": 2_000,
    }
    values.update(changes)
    return ServerRecord(**values)  # type: ignore[arg-type]


def test_servers_round_trip_and_save_replaces_the_row_of_the_same_key(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        a = _server()
        b = _server("127.0.0.1:20882", group="broker-2", role_in_group="slave")
        d = _server("127.0.0.1:20883", role="delay", group="delay-1")
        for record in (a, b, d):
            store.save_server(record)
        assert store.servers() == [a, b, d]

        a2 = _server(pid=5151, http="127.0.0.1:9090", registered_at_ms=3_000, last_heartbeat_ms=4_000)
        store.save_server(a2)
        assert store.servers() == [a2, b, d]
    finally:
        store.close()


def test_routes_only_grow_and_survive_reopening(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        assert store.routes() == {}
        assert store.routes_of("order.created") == []
        assert store.add_routes("order.created", ["broker-2", "broker-1"], 10) == ["broker-1", "broker-2"]
        # Adding what is there changes nothing; adding a new group keeps the old ones.
        assert store.add_routes("order.created", ["broker-1"], 11) == ["broker-1", "broker-2"]
        assert store.add_routes("order.created", ["broker-3", "broker-3"], 12) == [
            "broker-1",
            "broker-2",
            "broker-3",
        ]
        # Names are exact: a subject differing only in case is another subject.
        assert store.add_routes("Order.created", ["broker-2"], 13) == ["broker-2"]
        assert store.add_routes("%RETRY%order.created%billing", ["broker-1"], 14) == ["broker-1"]
    finally:
        store.close()

    reopened = MetaStore(db_url)
    try:
        assert reopened.routes() == {
            "%RETRY%order.created%billing": ["broker-1"],
            "Order.created": ["broker-2"],
            "order.created": ["broker-1", "broker-2", "broker-3"],
        }
        assert reopened.routes_of("order.created") == ["broker-1", "broker-2", "broker-3"]
    finally:
        reopened.close()


def test_sqlite_url_creates_the_data_dir(tmp_path: Path) -> None:
    data_dir = tmp_path / "a" / "b"
    store = MetaStore(sqlite_url(data_dir))
    store.close()
    assert (data_dir / "meta.db").is_file()


def test_a_data_dir_that_is_a_file_is_refused_naming_it(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "taken"
    not_a_dir.write_text("x")
    with pytest.raises(MetaStoreError, match=r"data_dir '.*taken'.*writable directory"):
        sqlite_url(not_a_dir)


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("not a url", r"db_url 'not a url' is not a usable SQLAlchemy URL"),
        ("nosuchdb://u@h/d", r"db_url 'nosuchdb://u@h/d' is not a usable SQLAlchemy URL"),
        (
            "postgresql+psycopg://postgres:secret@127.0.0.1:1/none",
            r"cannot open the meta store at 'postgresql\+psycopg://postgres:\*\*\*@127.0.0.1:1/none'",
        ),
    ],
)
def test_an_unusable_db_url_is_refused_naming_it_without_its_password(url: str, expected: str) -> None:
    with pytest.raises(MetaStoreError, match=expected) as info:
        MetaStore(url)
    assert "secret" not in str(info.value)
