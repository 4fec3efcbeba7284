"""After-commit hooks: run after a commit, never after a rollback, savepoints respected,
Core connections and ORM sessions alike, on SQLite, PostgreSQL and MariaDB."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import sqlalchemy as sa
from sqlalchemy.orm import Session

from qmq.common.errors import ConfigError
from qmq.tx import hooks
from scratch_dbs import Database


class Rollback(Exception):
    """Raised inside a transaction block to roll it back."""


@pytest.fixture
def sqlite(tmp_path: Path) -> Iterator[sa.Engine]:
    """For what does not depend on the database: the hooks' own bookkeeping."""
    engine = sa.create_engine(f"sqlite:///{tmp_path}/app.db")
    yield engine
    engine.dispose()


def _adder(log: list[str], item: str) -> Callable[[], None]:
    return lambda: log.append(item)


def test_commit_runs_and_rollback_does_not(engine: sa.Engine) -> None:
    hooks.install(engine)
    ran: list[str] = []
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT 1"))
        hooks.call_after_commit(conn, _adder(ran, "committed"))
        assert hooks.pending_count(conn) == 1
        assert ran == [], "nothing runs before the COMMIT"
    assert ran == ["committed"]

    with contextlib.suppress(Rollback), engine.begin() as conn:
        hooks.call_after_commit(conn, _adder(ran, "rolled back"))
        raise Rollback
    # The next transaction on the same pooled connection commits: the rolled-back call stays dropped.
    with engine.begin() as conn:
        conn.execute(sa.text("SELECT 1"))
    assert ran == ["committed"]


def test_savepoints_released_keep_and_rolled_back_drop(engine: sa.Engine) -> None:
    hooks.install(engine)
    ran: list[str] = []
    with engine.begin() as conn:
        hooks.call_after_commit(conn, _adder(ran, "outer"))
        with conn.begin_nested():
            hooks.call_after_commit(conn, _adder(ran, "released"))
            with contextlib.suppress(Rollback), conn.begin_nested():
                hooks.call_after_commit(conn, _adder(ran, "inner rolled back"))
                raise Rollback
        with contextlib.suppress(Rollback), conn.begin_nested():
            hooks.call_after_commit(conn, _adder(ran, "rolled back"))
            with conn.begin_nested():
                hooks.call_after_commit(conn, _adder(ran, "released into a rolled-back savepoint"))
            raise Rollback
    assert ran == ["outer", "released"]


def test_connect_commit_then_more_work(engine: sa.Engine) -> None:
    hooks.install(engine)
    ran: list[str] = []
    with engine.connect() as conn:
        conn.execute(sa.text("SELECT 1"))
        hooks.call_after_commit(conn, _adder(ran, "first"))
        conn.commit()
        assert ran == ["first"]
        conn.execute(sa.text("SELECT 1"))
        hooks.call_after_commit(conn, _adder(ran, "second"))
    # Closing without a commit rolls the second transaction back.
    assert ran == ["first"]


def test_session_commit_and_rollback(engine: sa.Engine) -> None:
    hooks.install(engine)
    ran: list[str] = []
    with Session(engine) as session:
        hooks.call_after_commit(session.connection(), _adder(ran, "session"))
        session.commit()
        hooks.call_after_commit(session.connection(), _adder(ran, "session rolled back"))
        session.rollback()
    assert ran == ["session"]


def test_a_failing_callback_never_fails_the_commit(sqlite: sa.Engine, caplog: pytest.LogCaptureFixture) -> None:
    engine = sqlite
    hooks.install(engine)
    ran: list[str] = []

    def boom() -> None:
        raise RuntimeError("callback trouble")

    with caplog.at_level(logging.ERROR, logger="qmq.tx.hooks"), engine.begin() as conn:
        hooks.call_after_commit(conn, boom)
        hooks.call_after_commit(conn, _adder(ran, "after the failing one"))
    assert ran == ["after the failing one"]
    assert "callback trouble" in caplog.text


def test_failed_commit_runs_nothing(pg: Database) -> None:
    # A deferred constraint is checked by the COMMIT itself: the commit raises.
    engine = pg.engine()
    hooks.install(engine)
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("CREATE TABLE t (k int, CONSTRAINT u UNIQUE (k) DEFERRABLE INITIALLY DEFERRED)"))
        ran: list[str] = []

        def insert_twice() -> None:
            with engine.begin() as conn:
                conn.execute(sa.text("INSERT INTO t VALUES (1), (1)"))
                hooks.call_after_commit(conn, _adder(ran, "never"))

        with pytest.raises(sa.exc.IntegrityError, match="violates unique constraint"):
            insert_twice()
        assert ran == []
        with engine.begin() as conn:
            conn.execute(sa.text("SELECT 1"))
        assert ran == []
    finally:
        engine.dispose()


def test_engine_copies_share_the_hooks(sqlite: sa.Engine) -> None:
    engine = sqlite
    hooks.install(engine)
    ran: list[str] = []
    with engine.execution_options(logging_token="copy").begin() as conn:
        hooks.call_after_commit(conn, _adder(ran, "copy"))
    assert ran == ["copy"]


def test_refusals_name_the_problem(tmp_path: Path) -> None:
    other = sa.create_engine(f"sqlite:///{tmp_path}/other.db")
    try:
        with other.connect() as conn, pytest.raises(ConfigError, match="no after-commit hooks"):
            hooks.call_after_commit(conn, lambda: None)
        hooks.install(other)
        with other.connect() as conn, pytest.raises(ConfigError, match="not in a transaction"):
            hooks.call_after_commit(conn, lambda: None)
    finally:
        other.dispose()
