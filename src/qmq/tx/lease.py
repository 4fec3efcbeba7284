"""The watchdog lease: at most one watchdog resends an outbox table's rows at a time.

A row of the lease table names the outbox table, its owner and when the lease ends. It is
taken or renewed with one conditional UPDATE (``WHERE owner = me OR expires_ms < now``),
and created with an insert that does nothing if another watchdog created it first: plain,
portable SQL whose row lock makes exactly one of two racing watchdogs win.

A lease measured by clocks cannot stop a watchdog that froze past its expiry from waking
up believing it still holds it; so the lease only keeps watchdogs from working in vain,
and the per-row claims in ``qmq.tx.watchdog`` are what keep a row from being sent twice
at once.
"""

from __future__ import annotations

import os
import secrets
import socket

import sqlalchemy as sa

from qmq.tx.portable import insert_if_absent


def default_owner() -> str:
    """``<host>-<pid>-<random>``: tells watchdogs apart in the lease table and in logs."""
    return f"{socket.gethostname()[:100]}-{os.getpid()}-{secrets.token_hex(4)}"


class Lease:
    """Take, renew and give up the lease on one outbox table in one database."""

    def __init__(self, engine: sa.Engine, table: sa.Table, name: str, owner: str, lease_ms: int) -> None:
        self._engine = engine
        self.name = name
        self.owner = owner
        self.lease_ms = lease_ms
        self._take = (
            table.update()
            .where(
                table.c.name == sa.bindparam("lease_name"),
                sa.or_(table.c.owner == sa.bindparam("me"), table.c.expires_ms < sa.bindparam("now")),
            )
            .values(owner=sa.bindparam("me"), expires_ms=sa.bindparam("until"))
        )
        self._create = insert_if_absent(table, engine.dialect.name)
        self._give_up = (
            table.update()
            .where(table.c.name == sa.bindparam("lease_name"), table.c.owner == sa.bindparam("me"))
            .values(expires_ms=0)
        )
        self._holder = sa.select(table.c.owner, table.c.expires_ms).where(table.c.name == sa.bindparam("lease_name"))

    def acquire(self, now_ms: int) -> bool:
        """Take or renew the lease until ``now_ms + lease_ms``; whether this owner holds it now."""
        params = {"lease_name": self.name, "me": self.owner, "now": now_ms, "until": now_ms + self.lease_ms}
        with self._engine.begin() as conn:
            if conn.execute(self._take, params).rowcount == 1:
                return True
        with self._engine.begin() as conn:
            created = conn.execute(
                self._create, {"name": self.name, "owner": self.owner, "expires_ms": now_ms + self.lease_ms}
            )
            return created.rowcount == 1

    def release(self) -> None:
        """End this owner's lease now, so another watchdog can take over at once."""
        with self._engine.begin() as conn:
            conn.execute(self._give_up, {"lease_name": self.name, "me": self.owner})

    def holder(self) -> tuple[str, int] | None:
        """(owner, expires_ms) of the lease, or None if nobody ever took it."""
        with self._engine.connect() as conn:
            row = conn.execute(self._holder, {"lease_name": self.name}).first()
        return None if row is None else (str(row[0]), int(row[1]))
