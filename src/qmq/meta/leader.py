"""Which meta server leads, when several share one database: a lease row, taken and renewed with
one conditional UPDATE.

``UPDATE qmq_meta_leases SET owner = me, expires_ms = now + lease WHERE name = 'leader' AND
(owner = me OR expires_ms < now)`` matches for the holder and, once the lease ran out, for
anyone; the row lock makes exactly one of two racing meta servers match. The first lease
ever is an INSERT that fails for the loser on the primary key. Plain SQL on every database.

Only the leader promotes. A lease measured by clocks cannot stop a leader that froze past
its expiry from waking up believing it still leads; that is why a promotion is itself a
conditional UPDATE on the epoch it starts from (``MetaStore.change_group``): two meta
servers can never both raise an epoch to the same number.
"""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass
from typing import Final

import sqlalchemy as sa
from sqlalchemy import exc as sa_exc

from qmq.meta.schema import OWNER_CHARS, URL_CHARS, leases_table
from qmq.meta.store import MetaStore

LEASE_NAME: Final = "leader"


def default_owner() -> str:
    """``<host>-<pid>-<random>``: tells meta servers apart in the lease row and in logs."""
    return f"{socket.gethostname()[:100]}-{os.getpid()}-{secrets.token_hex(4)}"[:OWNER_CHARS]


@dataclass(frozen=True, slots=True)
class Holder:
    """The meta server holding the lease, as last written."""

    owner: str
    url: str
    expires_ms: int


class LeaderLease:
    """Take, renew and give up the leader lease of the meta servers sharing ``store``."""

    def __init__(self, store: MetaStore, owner: str, url: str, lease_ms: int) -> None:
        if lease_ms <= 0:
            raise ValueError(f"lease_ms must be positive, got {lease_ms}")
        self._store = store
        self.owner = owner[:OWNER_CHARS]
        self.url = url[:URL_CHARS]
        self.lease_ms = lease_ms
        self._expires_ms = 0

    def acquire(self, now_ms: int) -> bool:
        """Take or renew the lease until ``now_ms + lease_ms``; whether this meta server leads now."""
        t = leases_table
        until = now_ms + self.lease_ms
        with self._store.transaction("take the leader lease") as conn:
            taken = conn.execute(
                sa.update(t)
                .where(t.c.name == LEASE_NAME, sa.or_(t.c.owner == self.owner, t.c.expires_ms < now_ms))
                .values(owner=self.owner, url=self.url, expires_ms=until)
            ).rowcount
        if taken != 1:
            try:
                with self._store.transaction("create the leader lease") as conn:
                    conn.execute(sa.insert(t).values(name=LEASE_NAME, owner=self.owner, url=self.url, expires_ms=until))
            except sa_exc.IntegrityError:
                self._expires_ms = 0
                return False  # the row exists: another meta server holds the lease
        self._expires_ms = until
        return True

    def leads(self, now_ms: int) -> bool:
        """Whether the lease this meta server last took is still running (no database round trip)."""
        return now_ms < self._expires_ms

    def release(self) -> None:
        """End this meta server's lease now, so another can take over at once."""
        t = leases_table
        self._expires_ms = 0
        with self._store.transaction("give up the leader lease") as conn:
            conn.execute(sa.update(t).where(t.c.name == LEASE_NAME, t.c.owner == self.owner).values(expires_ms=0))

    def holder(self) -> Holder | None:
        """The lease as stored, or None if no meta server ever took it."""
        t = leases_table
        with self._store.transaction("read the leader lease") as conn:
            row = conn.execute(sa.select(t.c.owner, t.c.url, t.c.expires_ms).where(t.c.name == LEASE_NAME)).first()
        return None if row is None else Holder(str(row.owner), str(row.url), int(row.expires_ms))
