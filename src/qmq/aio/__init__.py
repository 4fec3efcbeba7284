"""The asyncio SDK: ``from qmq.aio import Producer, Consumer, Message``.

The blocking SDK (``from qmq import Producer, Consumer``) has the same shape over these.
Every error qmq raises to a user is importable from here too, ``QmqError`` the base of them
all.
"""

from qmq.client.consumer import Consumer
from qmq.client.delays import PendingDelay
from qmq.client.message import Message
from qmq.client.producer import Producer
from qmq.client.pull_consumer import PullConsumer
from qmq.client.received import Batch, ReceivedMessage
from qmq.client.sender import ProducerStats
from qmq.common import errors as _errors
from qmq.common.errors import *  # noqa: F403 (every error class: errors.__all__)

__all__ = [
    "Batch",
    "Consumer",
    "Message",
    "PendingDelay",
    "Producer",
    "ProducerStats",
    "PullConsumer",
    "ReceivedMessage",
]
__all__ += _errors.__all__
