"""The meta server's group controls and subject records on every database it supports: paused
groups and subjects round-trip, outlive reopening the store, and names differing in case differ."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from meta_databases import fresh_database

from qmq.meta.controls import ControlsStore
from qmq.meta.store import MetaStore
from qmq.meta.subjects import SubjectRefusedError, SubjectsStore


@pytest.fixture(params=["sqlite", "postgresql", "mariadb"])
def db_url(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    with fresh_database(request.param, tmp_path) as db:
        yield db.url


def test_paused_groups_round_trip_and_outlive_a_reopen(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        controls = ControlsStore(store)
        assert controls.set_paused("Orders", "billing", True, 1) is False
        assert controls.set_paused("orders", "billing", True, 2) is False  # another subject
        assert controls.set_paused("Orders", "billing", True, 3) is True  # paused already
        assert controls.set_paused("Orders", "other", False, 4) is False  # never paused: no record
        assert controls.paused() == [("Orders", "billing"), ("orders", "billing")]
    finally:
        store.close()
    store = MetaStore(db_url)
    try:
        controls = ControlsStore(store)
        assert controls.paused() == [("Orders", "billing"), ("orders", "billing")]
        assert controls.set_paused("Orders", "billing", False, 5) is True
        assert controls.paused() == [("orders", "billing")]
    finally:
        store.close()


def test_group_filters_round_trip_and_outlive_a_reopen(db_url: str) -> None:
    long_expr = "body.note == '" + "\u00e9" * 4000 + "'"  # near the 4096-character limit, not ASCII
    store = MetaStore(db_url)
    try:
        controls = ControlsStore(store)
        assert controls.set_filter("Orders", "big", "body.amount > `100`", 1) is None
        assert controls.set_filter("orders", "big", long_expr, 2) is None  # another subject
        assert controls.set_filter("Orders", "big", "properties.region == 'eu'", 3) == "body.amount > `100`"
        assert controls.set_filter("Orders", "none", None, 4) is None  # nothing to clear
    finally:
        store.close()
    store = MetaStore(db_url)
    try:
        controls = ControlsStore(store)
        assert controls.filters() == [("Orders", "big", "properties.region == 'eu'"), ("orders", "big", long_expr)]
        assert controls.set_filter("Orders", "big", None, 5) == "properties.region == 'eu'"
        assert controls.filters() == [("orders", "big", long_expr)]
    finally:
        store.close()


def test_subjects_round_trip_and_are_unique(db_url: str) -> None:
    store = MetaStore(db_url)
    try:
        subjects = SubjectsStore(store)
        subjects.create({"subject": "Orders", "description": "caf\u00e9 orders", "owner": "team-a"}, 7)
        subjects.create({"subject": "orders", "description": "", "owner": "team-b"}, 8)
        with pytest.raises(SubjectRefusedError, match="subject 'Orders' exists already"):
            subjects.create({"subject": "Orders", "description": "", "owner": "x"}, 9)
        assert subjects.rows() == [
            {"subject": "Orders", "description": "caf\u00e9 orders", "owner": "team-a", "created_ms": 7},
            {"subject": "orders", "description": "", "owner": "team-b", "created_ms": 8},
        ]
        assert subjects.remove("Orders") is True
        assert subjects.remove("Orders") is False
        assert [r["subject"] for r in subjects.rows()] == ["orders"]
    finally:
        store.close()
