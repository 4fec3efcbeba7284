"""qmq: a message queue in the shape of Qunar's QMQ.

The blocking SDK lives here (``from qmq import Producer, Consumer``); the asyncio SDK is
``qmq.aio``, with the same names. Every error qmq raises to a user is importable from both,
``QmqError`` the base of them all.
"""

from typing import TYPE_CHECKING

from qmq.common import errors as _errors
from qmq.common.errors import *  # noqa: F403 (every error class: errors.__all__)

if TYPE_CHECKING:  # type checkers see the blocking SDK; at run time it is imported on first use
    from qmq.client.sync import Batch as Batch
    from qmq.client.sync import Consumer as Consumer
    from qmq.client.sync import Message as Message
    from qmq.client.sync import Producer as Producer
    from qmq.client.sync import PullConsumer as PullConsumer
    from qmq.client.sync import ReceivedMessage as ReceivedMessage

# The one place the version is written: pyproject.toml reads it from here (setuptools dynamic).
__version__ = "0.1.0"

# the blocking SDK's names, imported on first use: it pulls in threads and the asyncio SDK
_SYNC_NAMES = ("Batch", "Consumer", "Message", "Producer", "PullConsumer", "ReceivedMessage")

__all__ = ["Batch", "Consumer", "Message", "Producer", "PullConsumer", "ReceivedMessage", "__version__"]
__all__ += _errors.__all__


def __getattr__(name: str) -> object:
    if name in _SYNC_NAMES:
        from qmq.client import sync

        return getattr(sync, name)
    raise AttributeError(f"module 'qmq' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_SYNC_NAMES))
