"""The meta store: registered servers and subject routes in a SQL database.

SQLAlchemy 2 Core on a synchronous engine. SQLite in ``<data_dir>/meta.db`` by default;
``db_url`` selects any other database, so every statement here is portable SQL (no
dialect-only syntax, no upsert extensions): an upsert is an UPDATE, then an INSERT when
nothing matched, retried once when another writer inserted the same key in between.

The store is not thread-safe by design: the meta server calls it from one thread only.

Tables (created when absent):

    qmq_meta_servers  key (role, group_name, address)
        role              "broker" | "delay"
        group_name        broker or delay group
        address           host:port of the binary protocol
        http              host:port of the server's /metrics and /health
        pid               process id, so a restart at the same address is told from a heartbeat
        role_in_group     "master" | "slave"
        registered_at_ms  when this process first registered
        last_heartbeat_ms when it last reported itself

    qmq_meta_routes   key (subject, group_name)
        created_at_ms     when the subject was routed to the group

The tables carry a ``qmq_meta_`` prefix because the database behind ``db_url`` may be
shared with other applications.
"""

from __future__ import annotations

import contextlib
import errno
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc
from sqlalchemy.dialects import mysql

from qmq.common.errors import QmqError

# Column widths. Names are checked by qmq.common.naming before they get here; these only
# need to hold what passes that check (subjects up to the internal-subject limit).
_ROLE_CHARS = 16
_GROUP_CHARS = 100
_SUBJECT_CHARS = 255
ADDRESS_CHARS_MAX = 300

# One retry is enough for the only conflict possible: another writer inserting the same
# key between our UPDATE and INSERT; after it, the row exists and the UPDATE matches.
_WRITE_ATTEMPTS_MAX = 2


def _name(chars: int) -> sa.types.TypeEngine[str]:
    """A name column. MySQL and MariaDB compare strings case-insensitively by default, which
    would make subjects "Order" and "order" one key; their binary collation keeps names exact."""
    return sa.String(chars).with_variant(
        mysql.VARCHAR(chars, charset="utf8mb4", collation="utf8mb4_bin"), "mysql", "mariadb"
    )


_metadata = sa.MetaData()

servers_table = sa.Table(
    "qmq_meta_servers",
    _metadata,
    sa.Column("role", _name(_ROLE_CHARS), primary_key=True),
    sa.Column("group_name", _name(_GROUP_CHARS), primary_key=True),
    sa.Column("address", _name(ADDRESS_CHARS_MAX), primary_key=True),
    sa.Column("http", _name(ADDRESS_CHARS_MAX), nullable=False),
    sa.Column("pid", sa.BigInteger, nullable=False),
    sa.Column("role_in_group", _name(_ROLE_CHARS), nullable=False),
    sa.Column("registered_at_ms", sa.BigInteger, nullable=False),
    sa.Column("last_heartbeat_ms", sa.BigInteger, nullable=False),
)

routes_table = sa.Table(
    "qmq_meta_routes",
    _metadata,
    sa.Column("subject", _name(_SUBJECT_CHARS), primary_key=True),
    sa.Column("group_name", _name(_GROUP_CHARS), primary_key=True),
    sa.Column("created_at_ms", sa.BigInteger, nullable=False),
)


class MetaStoreError(QmqError):
    """The meta store cannot be opened, read or written; the message says which and why."""

    retriable = True


@dataclass(frozen=True, slots=True)
class ServerRecord:
    """One registered server process, as stored."""

    role: str
    group: str
    address: str
    http: str
    pid: int
    role_in_group: str
    registered_at_ms: int
    last_heartbeat_ms: int


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
    """Servers and routes in a SQL database; every method is one short transaction."""

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
        try:
            _metadata.create_all(self._engine, checkfirst=True)
        except sa_exc.SQLAlchemyError as exc:
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

    @contextlib.contextmanager
    def _transaction(self, what: str) -> Iterator[sa.Connection]:
        try:
            with self._engine.begin() as conn:
                yield conn
        except sa_exc.IntegrityError:
            raise
        except sa_exc.SQLAlchemyError as exc:
            raise MetaStoreError(
                f"meta store {self._url_shown!r}: cannot {what}: {_first_line(exc)}"
            ) from None

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
        }
        for attempt in range(_WRITE_ATTEMPTS_MAX):
            try:
                with self._transaction("save a server") as conn:
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
                        f"meta store {self._url_shown!r}: cannot save server {record.address}: "
                        f"{_first_line(exc)}"
                    ) from None

    def servers(self) -> list[ServerRecord]:
        t = servers_table
        with self._transaction("read the servers") as conn:
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
            )
            for r in rows
        ]

    def add_routes(self, subject: str, groups: Sequence[str], created_at_ms: int) -> list[str]:
        """Route ``subject`` to ``groups`` too (existing routes stay); return all its groups, sorted."""
        t = routes_table
        for attempt in range(_WRITE_ATTEMPTS_MAX):
            try:
                with self._transaction("save a route") as conn:
                    have = set(conn.scalars(sa.select(t.c.group_name).where(t.c.subject == subject)))
                    new = [g for g in dict.fromkeys(groups) if g not in have]
                    if new:
                        conn.execute(
                            sa.insert(t),
                            [
                                {"subject": subject, "group_name": g, "created_at_ms": created_at_ms}
                                for g in new
                            ],
                        )
                return sorted(have.union(new))
            except sa_exc.IntegrityError as exc:
                if attempt + 1 == _WRITE_ATTEMPTS_MAX:
                    raise MetaStoreError(
                        f"meta store {self._url_shown!r}: cannot route subject {subject!r}: "
                        f"{_first_line(exc)}"
                    ) from None
        raise AssertionError("unreachable: the loop returns or raises")

    def routes_of(self, subject: str) -> list[str]:
        t = routes_table
        with self._transaction("read a route") as conn:
            return sorted(conn.scalars(sa.select(t.c.group_name).where(t.c.subject == subject)))

    def routes(self) -> dict[str, list[str]]:
        """Every subject's groups, each list sorted."""
        t = routes_table
        out: dict[str, list[str]] = {}
        with self._transaction("read the routes") as conn:
            for subject, group in conn.execute(
                sa.select(t.c.subject, t.c.group_name).order_by(t.c.subject, t.c.group_name)
            ):
                out.setdefault(subject, []).append(group)
        return out


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
