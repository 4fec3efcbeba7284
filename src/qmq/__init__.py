"""qmq: a message queue in the shape of Qunar's QMQ.

The blocking SDK lives here (``from qmq import Producer, Consumer``); the asyncio
SDK is ``qmq.aio``. Errors a user can meet are importable from this package.
"""

from typing import TYPE_CHECKING

from qmq.common.errors import (
    BrokerError,
    BufferFullError,
    ConfigError,
    ConnectionLostError,
    InvalidMessageError,
    InvalidSubjectError,
    MessageTooLargeError,
    MetaServerError,
    NeedRetry,
    NoBrokerError,
    QmqError,
    SendError,
)

if TYPE_CHECKING:  # type checkers see the blocking SDK; at run time it is imported on first use
    from qmq.client.sync import Consumer as Consumer
    from qmq.client.sync import Message as Message
    from qmq.client.sync import Producer as Producer

# The one place the version is written: pyproject.toml reads it from here (setuptools dynamic).
__version__ = "0.1.0"

__all__ = [
    "BrokerError",
    "BufferFullError",
    "ConfigError",
    "ConnectionLostError",
    "InvalidMessageError",
    "InvalidSubjectError",
    "MessageTooLargeError",
    "MetaServerError",
    "NeedRetry",
    "NoBrokerError",
    "QmqError",
    "SendError",
    "__version__",
]


def __getattr__(name: str) -> object:
    # The blocking SDK pulls in threads and the asyncio SDK; import it only when asked.
    if name in ("Producer", "Consumer", "Message"):
        from qmq.client import sync

        return getattr(sync, name)
    raise AttributeError(f"module 'qmq' has no attribute {name!r}")
