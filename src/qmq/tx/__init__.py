"""Transactional sends (the outbox): a message is sent if, and only if, the transaction commits.

``TransactionalProducer(producer, engine).send(conn, message)`` writes the message into an
outbox table in the application's own transaction; after the commit it is sent at once and
its row deleted; a ``Watchdog`` (``qmq watchdog``) resends rows left behind by a crash or
an unreachable broker. The asyncio variant is ``qmq.aio.tx``. See docs/transactions.md.

Imports ``qmq.client``, ``qmq.protocol`` and ``qmq.common``; of qmq, only the CLI,
``qmq.aio.tx`` and ``qmq.idempotency`` (for portable SQL) import it.
"""

from qmq.tx.producer import TransactionalProducer
from qmq.tx.rows import OutboxRow
from qmq.tx.schema import DEFAULT_LEASE_TABLE, DEFAULT_OUTBOX_TABLE, create_outbox_tables
from qmq.tx.watchdog import PassReport, Watchdog, list_blocked, unblock

__all__ = [
    "DEFAULT_LEASE_TABLE",
    "DEFAULT_OUTBOX_TABLE",
    "OutboxRow",
    "PassReport",
    "TransactionalProducer",
    "Watchdog",
    "create_outbox_tables",
    "list_blocked",
    "unblock",
]
