"""Idempotent consumers: skip a message already processed successfully.

Every checker has ``run(message, handler)`` (or ``await run_async(message, handler)``): it
returns ``Outcome.DUPLICATE`` without calling the handler when the message's key is
recorded as done, and otherwise calls the handler and records the key only if the handler
returned. Where the records live:

- ``MemoryIdempotentChecker``: this process, bounded in entries and time;
- ``SqlIdempotentChecker``: a table of a SQL database, apart from the handler's work;
- ``TransactionalIdempotentChecker`` / ``AsyncTransactionalIdempotentChecker``: a table
  written in the same transaction as the handler's own database work (``handler(message,
  conn)``), so a message is applied exactly once even across a crash before the ack;
- ``RedisIdempotentChecker`` / ``AsyncRedisIdempotentChecker``: Redis.

See docs/transactions.md. Redis and the database drivers are the application's own
dependencies.
"""

from typing import TYPE_CHECKING

from qmq.idempotency.base import (
    AsyncIdempotentChecker,
    DuplicateMessageError,
    IdempotentChecker,
    MessageInProgressError,
    Outcome,
)
from qmq.idempotency.memory import MemoryIdempotentChecker

if TYPE_CHECKING:
    from qmq.idempotency.redis_checker import AsyncRedisIdempotentChecker, RedisIdempotentChecker
    from qmq.idempotency.sql import SqlIdempotentChecker
    from qmq.idempotency.transactional import AsyncTransactionalIdempotentChecker, TransactionalIdempotentChecker

__all__ = [
    "AsyncIdempotentChecker",
    "AsyncRedisIdempotentChecker",
    "AsyncTransactionalIdempotentChecker",
    "DuplicateMessageError",
    "IdempotentChecker",
    "MemoryIdempotentChecker",
    "MessageInProgressError",
    "Outcome",
    "RedisIdempotentChecker",
    "SqlIdempotentChecker",
    "TransactionalIdempotentChecker",
]

_LAZY = {
    "AsyncRedisIdempotentChecker": "qmq.idempotency.redis_checker",
    "RedisIdempotentChecker": "qmq.idempotency.redis_checker",
    "SqlIdempotentChecker": "qmq.idempotency.sql",
    "AsyncTransactionalIdempotentChecker": "qmq.idempotency.transactional",
    "TransactionalIdempotentChecker": "qmq.idempotency.transactional",
}


def __getattr__(name: str) -> object:
    # SQLAlchemy is imported only by those who use a SQL checker.
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'qmq.idempotency' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
