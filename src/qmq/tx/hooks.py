"""Calls made after a database transaction commits, and never after it rolls back.

SQLAlchemy's Core has no "after commit" event (its ``commit`` connection event fires
before the COMMIT is sent, and the maintainers declined an after-event: sqlalchemy#4943).
A Session has ``after_commit``, but an application may hand us a plain Connection. So the
transaction boundaries are taken where every path goes through them, Core or ORM, sync or
asyncio: the engine dialect's ``do_begin``, ``do_commit``, ``do_rollback`` and savepoint
methods, each wrapped once per dialect instance (engines made by ``execution_options()``
share it). The wrappers call the original first, so a COMMIT that raises runs nothing.

What is waiting for a commit sits in the DBAPI connection's ``info`` dict (its pool
record's, so it lives exactly as long as that connection), as a stack of frames: the
transaction's, and one per open savepoint. Rolling back to a savepoint drops its frames,
releasing it merges them down, a rollback drops everything, and a BEGIN clears whatever a
connection invalidated mid-transaction may have left behind.

A callback runs on the thread that committed, inside the commit call: it must be short,
must not touch the connection, and must not raise (what it raises is logged, never passed
to the application, whose data is committed by then).
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import Any

import sqlalchemy as sa

from qmq.common.errors import ConfigError

log = logging.getLogger(__name__)

_KEY = "qmq.tx.after_commit"
_Frame = tuple[str | None, list[Callable[[], None]]]

_installed: weakref.WeakSet[sa.engine.Dialect] = weakref.WeakSet()
_install_lock = threading.Lock()


def install(engine: sa.Engine) -> None:
    """Wrap the transaction methods of ``engine``'s dialect (once; later calls do nothing)."""
    dialect = engine.dialect
    with _install_lock:
        if dialect in _installed:
            return
        _wrap(dialect, "do_begin", _before(_clear))
        _wrap(dialect, "do_commit", _commit)
        _wrap(dialect, "do_rollback", _before(_clear))
        _wrap(dialect, "do_savepoint", _after_savepoint)
        _wrap(dialect, "do_rollback_to_savepoint", _after_rollback_to_savepoint)
        _wrap(dialect, "do_release_savepoint", _after_release_savepoint)
        _installed.add(dialect)


def is_installed(engine: sa.Engine) -> bool:
    return engine.dialect in _installed


def call_after_commit(conn: sa.Connection, callback: Callable[[], None]) -> None:
    """Run ``callback()`` once the transaction ``conn`` is in commits; never if it rolls back.

    Raises ConfigError when ``conn``'s engine has no hooks (``install`` was not called for
    it) or ``conn`` is not in a transaction.
    """
    if conn.engine.dialect not in _installed:
        raise ConfigError(
            f"connection of engine {conn.engine.url.render_as_string()!r} has no after-commit hooks: "
            "it is not the engine the TransactionalProducer was made with; use a connection of that engine"
        )
    if not conn.in_transaction():
        raise ConfigError("the connection is not in a transaction; use `with engine.begin() as conn:`")
    frames = _frames(conn.info, create=True)
    assert frames is not None
    frames[-1][1].append(callback)


def pending_count(conn: sa.Connection) -> int:
    """Callbacks waiting for ``conn``'s commit (for tests and diagnostics)."""
    frames = _frames(conn.info, create=False)
    return 0 if frames is None else sum(len(calls) for _, calls in frames)


def _frames(info: dict[Any, Any], create: bool) -> list[_Frame] | None:
    frames: list[_Frame] | None = info.get(_KEY)
    if frames is None and create:
        frames = [(None, [])]
        info[_KEY] = frames
    return frames


def _wrap(dialect: sa.engine.Dialect, method: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> None:
    original = getattr(dialect, method)
    # An instance attribute shadows the class's method for this dialect object only.
    setattr(dialect, method, make(original))


def _info_of(connection: Any) -> dict[Any, Any] | None:
    # The engine's first-connect check rolls back a bare wrapper that has no info dict.
    try:
        info: dict[Any, Any] = connection.info
    except (AttributeError, NotImplementedError):
        return None
    return info


def _clear(connection: Any) -> None:
    info = _info_of(connection)
    if info is not None:
        info.pop(_KEY, None)


def _before(effect: Callable[[Any], None]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    def make(original: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(dbapi_connection: Any) -> None:
            effect(dbapi_connection)
            original(dbapi_connection)

        return wrapper

    return make


def _commit(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_commit(dbapi_connection: Any) -> None:
        info = _info_of(dbapi_connection)
        frames: list[_Frame] | None = None if info is None else info.pop(_KEY, None)
        # A COMMIT that raises may or may not have committed: nothing runs, and an outbox
        # row that did commit is left to the watchdog.
        original(dbapi_connection)
        if frames:
            _run(frames)

    return do_commit


def _run(frames: list[_Frame]) -> None:
    for _, calls in frames:
        for call in calls:
            try:
                call()
            except Exception:
                log.exception("an after-commit callback raised; the transaction is committed regardless")


def _after_savepoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_savepoint(connection: sa.Connection, name: str) -> None:
        original(connection, name)
        frames = _frames(connection.info, create=True)
        assert frames is not None
        frames.append((name, []))

    return do_savepoint


def _savepoint_index(frames: list[_Frame], name: str) -> int | None:
    for i in range(len(frames) - 1, 0, -1):
        if frames[i][0] == name:
            return i
    return None


def _after_rollback_to_savepoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_rollback_to_savepoint(connection: sa.Connection, name: str) -> None:
        frames = _frames(connection.info, create=False)
        if frames is not None:
            i = _savepoint_index(frames, name)
            if i is not None:
                del frames[i:]
        original(connection, name)

    return do_rollback_to_savepoint


def _after_release_savepoint(original: Callable[..., Any]) -> Callable[..., Any]:
    def do_release_savepoint(connection: sa.Connection, name: str) -> None:
        original(connection, name)
        frames = _frames(connection.info, create=False)
        if frames is not None:
            i = _savepoint_index(frames, name)
            if i is not None:
                merged = [call for _, calls in frames[i:] for call in calls]
                del frames[i:]
                frames[-1][1].extend(merged)

    return do_release_savepoint
