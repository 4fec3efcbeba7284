"""The deduplication table of the SQL checkers, its statements, and the purge of expired records.

    qmq_deduplication (name configurable)
        record_key   VARCHAR(255), primary key: [group/]subject/key (qmq.idempotency.base.RecordKeys)
        state        'processing' (claimed by a delivery) or 'done'
        owner        the claiming delivery's token while processing, else NULL
        expires_ms   processing: the claim's lease ends; done: the record may be forgotten (epoch ms)
        created_ms   when the record was first written (epoch ms)
        index (expires_ms): what the purge looks for

The transactional checker writes only 'done' rows, in the handler's transaction. Expired
records are deleted in bounded batches at most every ``purge_interval_ms``; until then a
'done' record past its TTL still counts as done (a TTL bounds how long a record is kept,
it does not promise the message is forgotten at once).
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any

import sqlalchemy as sa
from sqlalchemy.ext.asyncio import AsyncEngine

from qmq.tx.portable import insert_if_absent
from qmq.tx.schema import check_table_name, name_column

log = logging.getLogger(__name__)

DEFAULT_DEDUP_TABLE = "qmq_deduplication"
STATE_PROCESSING = "processing"
STATE_DONE = "done"
_OWNER_CHARS = 64
# Records deleted per purge statement, and statements per purge.
PURGE_BATCH_ROWS = 1_000
PURGE_BATCHES_MAX = 10


@functools.cache
def dedup_table(name: str) -> sa.Table:
    check_table_name(name)
    table = sa.Table(
        name,
        sa.MetaData(),
        sa.Column("record_key", name_column(255), primary_key=True),
        sa.Column("state", sa.String(16), nullable=False),
        sa.Column("owner", sa.String(_OWNER_CHARS), nullable=True),
        sa.Column("expires_ms", sa.BigInteger, nullable=True),
        sa.Column("created_ms", sa.BigInteger, nullable=False),
    )
    sa.Index(f"ix_{name}_expires"[:63], table.c.expires_ms)
    return table


class Statements:
    """The statements of one deduplication table on one dialect."""

    def __init__(self, table: sa.Table, dialect_name: str) -> None:
        c = table.c
        self.table = table
        self.insert = insert_if_absent(table, dialect_name)
        self.take_expired = (
            table.update()
            .where(c.record_key == sa.bindparam("key"), c.expires_ms < sa.bindparam("now"))
            .values(state=STATE_PROCESSING, owner=sa.bindparam("token"), expires_ms=sa.bindparam("until"))
        )
        self.state_of = sa.select(c.state, c.expires_ms).where(c.record_key == sa.bindparam("key"))
        self.finish = (
            table.update()
            .where(c.record_key == sa.bindparam("key"), c.owner == sa.bindparam("token"))
            .values(state=STATE_DONE, owner=None, expires_ms=sa.bindparam("until"))
        )
        self.mark_done = (
            table.update()
            .where(c.record_key == sa.bindparam("key"))
            .values(state=STATE_DONE, owner=None, expires_ms=sa.bindparam("until"))
        )
        self.release = table.delete().where(c.record_key == sa.bindparam("key"), c.owner == sa.bindparam("token"))
        self.expired = sa.select(c.record_key).where(c.expires_ms < sa.bindparam("now")).limit(sa.bindparam("limit"))
        self.delete_keys = table.delete().where(
            c.record_key.in_(sa.bindparam("keys", expanding=True)), c.expires_ms < sa.bindparam("now")
        )


def record(key: str, state: str, owner: str | None, expires_ms: int | None, now_ms: int) -> dict[str, Any]:
    return {"record_key": key, "state": state, "owner": owner, "expires_ms": expires_ms, "created_ms": now_ms}


class Purger:
    """Deletes expired records at most every ``interval_ms``; errors are logged, never raised."""

    def __init__(self, statements: Statements, interval_ms: int) -> None:
        self._st = statements
        self._interval_ms = interval_ms
        self._next_ms = 0
        self._lock = threading.Lock()

    def due(self, now_ms: int) -> bool:
        """Whether a purge should run now; the caller that gets True runs it."""
        with self._lock:
            if now_ms < self._next_ms:
                return False
            self._next_ms = now_ms + self._interval_ms
            return True

    def purge(self, engine: sa.Engine, now_ms: int) -> int:
        deleted = 0
        try:
            for _ in range(PURGE_BATCHES_MAX):
                with engine.begin() as conn:
                    keys = list(conn.scalars(self._st.expired, {"now": now_ms, "limit": PURGE_BATCH_ROWS}))
                    if keys:
                        deleted += conn.execute(self._st.delete_keys, {"keys": keys, "now": now_ms}).rowcount
                if len(keys) < PURGE_BATCH_ROWS:
                    break
        except sa.exc.SQLAlchemyError as exc:
            log.warning("purging expired records of %s failed: %s; tried again later", self._st.table.name, exc)
        return deleted

    async def purge_async(self, engine: AsyncEngine, now_ms: int) -> int:
        deleted = 0
        try:
            for _ in range(PURGE_BATCHES_MAX):
                async with engine.begin() as conn:
                    keys = list(await conn.scalars(self._st.expired, {"now": now_ms, "limit": PURGE_BATCH_ROWS}))
                    if keys:
                        result = await conn.execute(self._st.delete_keys, {"keys": keys, "now": now_ms})
                        deleted += result.rowcount
                if len(keys) < PURGE_BATCH_ROWS:
                    break
        except sa.exc.SQLAlchemyError as exc:
            log.warning("purging expired records of %s failed: %s; tried again later", self._st.table.name, exc)
        return deleted
