"""The meta store: registered servers, group decisions, epochs and subject routes in a SQL database.

SQLAlchemy 2 Core on a synchronous engine. SQLite in ``<data_dir>/meta.db`` by default;
``db_url`` selects any other database, so every statement here is portable SQL (no
dialect-only syntax, no upsert extensions): an upsert is an UPDATE, then an INSERT when
nothing matched, retried once when another writer inserted the same key in between. A
decision about a group is a conditional UPDATE on the epoch and master it was made from, so
of two meta servers deciding at once exactly one wins. The tables are drawn in
``qmq.meta.schema``.

The store is not thread-safe by design: the meta server calls it from one thread only.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from qmq.common.errors import QmqError
from qmq.meta.schema import (
    ADDRESS_CHARS_MAX,
    EPOCHS_KEPT,
    create_or_upgrade,
    epochs_table,
    groups_table,
    routes_table,
    servers_table,
)

__all__ = ["ADDRESS_CHARS_MAX", "GroupRecord", "MetaStore", "MetaStoreError", "ServerRecord", "sqlite_url"]

# One retry is enough for the only conflict possible: another writer inserting the same
# key between our UPDATE and INSERT; after it, the row exists and the UPDATE matches.
_WRITE_ATTEMPTS_MAX = 2
# Subjects named in one IN (...) of a query: far inside every database's limit on bound parameters.
_SUBJECTS_PER_QUERY_MAX = 500


class MetaStoreError(QmqError):
    """The meta store cannot be opened, read or written; the message says which and why."""

    retriable = True


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """One registered server process, as it last reported itself."""

    role: str
    group: str
    address: str
    http: str
    pid: int
    role_in_group: str
    registered_at_ms: int
    last_heartbeat_ms: int
    epoch: int | None = None
    log_end: int = 0
    action_end: int = 0
    replicated_ms: int = 0
    write_state: str | None = None


@dataclass(frozen=True, slots=True)
class GroupRecord:
    """What the meta server decided about a group: its epoch and the master of that epoch.

    ``message_offset`` and ``action_offset`` are where the master's logs stood when it was
    promoted (None: the epoch began without a promotion, with the group's first master).
    """

    role: str
    group: str
    epoch: int
    master: str
    message_offset: int | None
    action_offset: int | None
    changed_at_ms: int
    changed_by: str


def sqlite_url(data_dir: Path) -> str:
    """The URL of ``<data_dir>/meta.db``, creating the directory; MetaStoreError when it cannot be used."""
    try:
        data_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        if exc.errno == errno.EEXIST:
            reason = "a file of that name exists"
        raise MetaStoreError(
            f"data_dir {str(data_dir)!r} cannot be used as the meta store's directory ({reason}); "
            "set data_dir to a writable directory"
        ) from None
    return sa.URL.create("sqlite", database=str(data_dir / "meta.db")).render_as_string()


def _shown(url: str) -> str:
    """The URL as it may appear in an error: without its password."""
    try:
        return sa.make_url(url).render_as_string(hide_password=True)
    except sa_exc.ArgumentError:
        return url


class MetaStore:
    """Servers, groups, epochs and routes in a SQL database; every method is one short transaction."""

    def __init__(self, url: str) -> None:
        """Connect to ``url`` and create the tables if absent; MetaStoreError on any failure."""
        self._url_shown = _shown(url)
        try:
            self._engine = sa.create_engine(url, pool_pre_ping=True)
        except (sa_exc.ArgumentError, sa_exc.NoSuchModuleError) as exc:
            raise MetaStoreError(
                f"db_url {self._url_shown!r} is not a usable SQLAlchemy URL ({exc}); "
                "use e.g. postgresql+psycopg://user@host/db, or leave db_url empty for SQLite in data_dir"
            ) from None
        except ImportError as exc:
            raise MetaStoreError(
                f"db_url {self._url_shown!r} needs a database driver that is not installed ({exc}); "
                "install the driver or choose another URL"
            ) from None
        if self._engine.dialect.name == "sqlite":
            # WAL makes each commit one append and fsync instead of a journal dance; the
            # heartbeat of every server is a commit.
            sa.event.listen(self._engine, "connect", _sqlite_wal)
        for attempt in range(_WRITE_ATTEMPTS_MAX):
            try:
                with self._engine.begin() as conn:
                    create_or_upgrade(conn)
                break
            except sa_exc.SQLAlchemyError as exc:
                # Meta servers started together race to create the tables; the loser's second
                # look finds them.
                if attempt + 1 < _WRITE_ATTEMPTS_MAX:
                    continue
                self._engine.dispose()
                raise MetaStoreError(
                    f"cannot open the meta store at {self._url_shown!r}: {_first_line(exc)}; "
                    "check that the database is running and writable by this user"
                ) from None

    @property
    def url_shown(self) -> str:
        return self._url_shown

    def close(self) -> None:
        self._engine.dispose()

    @property
    def dialect(self) -> str:
        return self._engine.dialect.name

    @contextlib.contextmanager
    def transaction(self, what: str) -> Iterator[sa.Connection]:
        """One transaction; a database failure becomes MetaStoreError naming ``what`` (IntegrityError passes)."""
        try:
            with self._engine.begin() as conn:
                yield conn
        except sa_exc.IntegrityError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            raise MetaStoreError(f"meta store {self._url_shown!r}: cannot {what}: {_first_line(exc)}") from None

    def save_server(self, record: ServerRecord) -> None:
        """Insert or replace the row of ``record``'s (role, group, address)."""
        t = servers_table
        key = (t.c.role == record.role) & (t.c.group_name == record.group) & (t.c.address == record.address)
        values = {
            "http": record.http,
            "pid": record.pid,
            "role_in_group": record.role_in_group,
            "registered_at_ms": record.registered_at_ms,
            "last_heartbeat_ms": record.last_heartbeat_ms,
            "epoch": record.epoch,
            "log_end": record.log_end,
            "action_end": record.action_end,
            "replicated_ms": record.replicated_ms,
            "write_state": record.write_state,
        }
        for attempt in range(_WRITE_ATTEMPTS_MAX):
            try:
                with self.transaction("save a server") as conn:
                    if conn.execute(sa.update(t).where(key).values(values)).rowcount == 0:
                        conn.execute(
                            sa.insert(t).values(
                                role=record.role, group_name=record.group, address=record.address, **values
                            )
                        )
                return
            except sa_exc.IntegrityError as exc:
                if attempt + 1 == _WRITE_ATTEMPTS_MAX:
                    raise MetaStoreError(
                        f"meta store {self._url_shown!r}: cannot save server {record.address}: {_first_line(exc)}"
                    ) from None

    def servers(self) -> list[ServerRecord]:
        t = servers_table
        with self.transaction("read the servers") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.role, t.c.group_name, t.c.address)).all()
        return [
            ServerRecord(
                role=r.role,
                group=r.group_name,
                address=r.address,
                http=r.http,
                pid=r.pid,
                role_in_group=r.role_in_group,
                registered_at_ms=r.registered_at_ms,
                last_heartbeat_ms=r.last_heartbeat_ms,
                epoch=r.epoch,
                log_end=r.log_end,
                action_end=r.action_end,
                replicated_ms=r.replicated_ms,
                write_state=r.write_state,
            )
            for r in rows
        ]

    def forget_servers(self, silent_before_ms: int) -> int:
        """Delete the servers silent since before ``silent_before_ms``, except a group's master; how many."""
        s, g = servers_table, groups_table
        is_master = sa.exists().where(g.c.role == s.c.role, g.c.group_name == s.c.group_name, g.c.master == s.c.address)
        with self.transaction("forget silent servers") as conn:
            return int(conn.execute(sa.delete(s).where(s.c.last_heartbeat_ms < silent_before_ms, ~is_master)).rowcount)

    def group(self, role: str, group: str) -> GroupRecord | None:
        t = groups_table
        with self.transaction("read a group") as conn:
            row = conn.execute(sa.select(t).where(t.c.role == role, t.c.group_name == group)).first()
        return None if row is None else _group_record(row)

    def groups(self) -> list[GroupRecord]:
        t = groups_table
        with self.transaction("read the groups") as conn:
            rows = conn.execute(sa.select(t).order_by(t.c.role, t.c.group_name)).all()
        return [_group_record(r) for r in rows]

    def create_group(self, record: GroupRecord) -> GroupRecord:
        """Store ``record`` unless its group has a row already; the row stored either way."""
        try:
            with self.transaction("create a group") as conn:
                conn.execute(sa.insert(groups_table).values(_group_values(record)))
            return record
        except sa_exc.IntegrityError:
            pass  # another meta server created it first: its decision stands
        stored = self.group(record.role, record.group)
        if stored is None:
            raise MetaStoreError(
                f"meta store {self._url_shown!r}: group {record.group!r} could not be created and is not there"
            )
        return stored

    def change_group(self, before: GroupRecord, after: GroupRecord) -> bool:
        """Replace ``before`` by ``after`` if the stored row is still at ``before``'s epoch and master.

        A promotion (``after`` at a higher epoch, with offsets) is recorded in the epochs table
        in the same transaction. False when the row changed meanwhile (nothing is written).
        """
        t = groups_table
        e = epochs_table
        try:
            with self.transaction("change a group") as conn:
                changed = conn.execute(
                    sa.update(t)
                    .where(
                        t.c.role == before.role,
                        t.c.group_name == before.group,
                        t.c.epoch == before.epoch,
                        t.c.master == before.master,
                    )
                    .values(_group_values(after))
                ).rowcount
                if changed != 1:
                    return False
                if after.epoch > before.epoch and after.message_offset is not None:
                    conn.execute(
                        sa.insert(e).values(
                            role=after.role,
                            group_name=after.group,
                            epoch=after.epoch,
                            master=after.master,
                            message_offset=after.message_offset,
                            action_offset=after.action_offset or 0,
                            started_at_ms=after.changed_at_ms,
                        )
                    )
                    conn.execute(
                        sa.delete(e).where(
                            e.c.role == after.role,
                            e.c.group_name == after.group,
                            e.c.epoch <= after.epoch - EPOCHS_KEPT,
                        )
                    )
                return True
        except sa_exc.IntegrityError:
            return False  # an epoch row of that number exists: another decision got there first

    def offsets_after(self, role: str, group: str, epoch: int) -> tuple[int, int] | None:
        """(message, action) offsets where the epoch after ``epoch`` began: where a server that
        worked in ``epoch`` must cut its logs. When that epoch's row is no longer kept, the
        smallest offsets of the later epochs kept (cutting earlier only costs a longer copy).
        None when no later epoch began with a promotion."""
        e = epochs_table
        with self.transaction("read the epochs") as conn:
            rows = conn.execute(
                sa.select(e.c.epoch, e.c.message_offset, e.c.action_offset)
                .where(e.c.role == role, e.c.group_name == group, e.c.epoch > epoch)
                .order_by(e.c.epoch)
                .limit(EPOCHS_KEPT)
            ).all()
        if not rows:
            return None
        if rows[0].epoch == epoch + 1:
            return int(rows[0].message_offset), int(rows[0].action_offset)
        return min(int(r.message_offset) for r in rows), min(int(r.action_offset) for r in rows)

    def add_routes(self, subject: str, groups: Sequence[str], created_at_ms: int) -> list[str]:
        """Route ``subject`` to ``groups`` too (existing routes stay); return all its groups, sorted."""
        return self.add_routes_many({subject: groups}, created_at_ms)[subject]

    def add_routes_many(self, plans: Mapping[str, Sequence[str]], created_at_ms: int) -> dict[str, list[str]]:
        """Route each subject of ``plans`` to its groups too (existing routes stay), in one
        transaction: one commit (one fsync of SQLite's WAL) for a request's new subjects, not one
        each. Returns every subject's groups, sorted."""
        t = routes_table
        for attempt in range(_WRITE_ATTEMPTS_MAX):
            try:
                with self.transaction("save routes") as conn:
                    have = self._routes_in(conn, list(plans))
                    new = [
                        (subject, g)
                        for subject, groups in plans.items()
                        for g in dict.fromkeys(groups)
                        if g not in have.get(subject, ())
                    ]
                    if new:
                        conn.execute(
                            sa.insert(t),
                            [{"subject": s, "group_name": g, "created_at_ms": created_at_ms} for s, g in new],
                        )
                out = {subject: set(have.get(subject, ())) for subject in plans}
                for subject, g in new:
                    out[subject].add(g)
                return {subject: sorted(groups) for subject, groups in out.items()}
            except sa_exc.IntegrityError as exc:
                if attempt + 1 == _WRITE_ATTEMPTS_MAX:
                    named = ", ".join(repr(s) for s in list(plans)[:3]) + (" and more" if len(plans) > 3 else "")
                    raise MetaStoreError(
                        f"meta store {self._url_shown!r}: cannot route subject {named}: {_first_line(exc)}"
                    ) from None
        raise AssertionError("unreachable: the loop returns or raises")

    def routes_of(self, subject: str) -> list[str]:
        return self.routes_of_many([subject]).get(subject, [])

    def routes_of_many(self, subjects: Sequence[str]) -> dict[str, list[str]]:
        """The stored groups of each of ``subjects`` that has any (sorted), read in one transaction."""
        with self.transaction("read routes") as conn:
            return {subject: sorted(groups) for subject, groups in self._routes_in(conn, subjects).items()}

    @staticmethod
    def _routes_in(conn: sa.Connection, subjects: Sequence[str]) -> dict[str, list[str]]:
        t = routes_table
        out: dict[str, list[str]] = {}
        for at in range(0, len(subjects), _SUBJECTS_PER_QUERY_MAX):
            part = subjects[at : at + _SUBJECTS_PER_QUERY_MAX]
            for subject, group in conn.execute(sa.select(t.c.subject, t.c.group_name).where(t.c.subject.in_(part))):
                out.setdefault(subject, []).append(group)
        return out

    def routes(self, subjects_max: int | None = None) -> dict[str, list[str]]:
        """Every subject's groups (the first ``subjects_max`` subjects by name), each list sorted."""
        t = routes_table
        query = sa.select(t.c.subject, t.c.group_name).order_by(t.c.subject, t.c.group_name)
        if subjects_max is not None:
            first = sa.select(t.c.subject).distinct().order_by(t.c.subject).limit(subjects_max).subquery()
            query = query.where(t.c.subject.in_(sa.select(first.c.subject)))
        out: dict[str, list[str]] = {}
        with self.transaction("read the routes") as conn:
            for subject, group in conn.execute(query):
                out.setdefault(subject, []).append(group)
        return out

    def subjects_routed(self) -> int:
        t = routes_table
        with self.transaction("count the routes") as conn:
            return int(conn.scalar(sa.select(sa.func.count(sa.distinct(t.c.subject)))) or 0)


def _group_values(record: GroupRecord) -> dict[str, object]:
    return {
        "role": record.role,
        "group_name": record.group,
        "epoch": record.epoch,
        "master": record.master,
        "message_offset": record.message_offset,
        "action_offset": record.action_offset,
        "changed_at_ms": record.changed_at_ms,
        "changed_by": record.changed_by,
    }


def _group_record(r: sa.Row[Any]) -> GroupRecord:
    return GroupRecord(
        role=r.role,
        group=r.group_name,
        epoch=r.epoch,
        master=r.master,
        message_offset=r.message_offset,
        action_offset=r.action_offset,
        changed_at_ms=r.changed_at_ms,
        changed_by=r.changed_by,
    )


def _sqlite_wal(dbapi_conn: object, _record: object) -> None:
    cursor = dbapi_conn.cursor()  # type: ignore[attr-defined]
    try:
        cursor.execute("PRAGMA journal_mode=WAL")
    finally:
        cursor.close()


def _first_line(exc: BaseException) -> str:
    """A driver error's own message, without SQLAlchemy's statement dump and help link."""
    orig = getattr(exc, "orig", None)
    text = str(orig if orig is not None else exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__
