"""The asyncio SDK: ``from qmq.aio import Producer, Consumer, Message``.

The blocking SDK (``from qmq import Producer, Consumer``) has the same shape over these.
Every error qmq raises to a user is importable from here too, ``QmqError`` the base of them
all.
"""

from qmq.client.consumer import Consumer, PullConsumer
from qmq.client.message import Message
from qmq.client.producer import Producer
from qmq.client.received import Batch, ReceivedMessage
from qmq.client.sender import ProducerStats
from qmq.common.errors import (
    AlreadyProcessedError,
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
    QmqTimeoutError,
    SendError,
)

__all__ = [
    "AlreadyProcessedError",
    "Batch",
    "BrokerError",
    "BufferFullError",
    "ConfigError",
    "ConnectionLostError",
    "Consumer",
    "InvalidMessageError",
    "InvalidSubjectError",
    "Message",
    "MessageTooLargeError",
    "MetaServerError",
    "NeedRetry",
    "NoBrokerError",
    "Producer",
    "ProducerStats",
    "PullConsumer",
    "QmqError",
    "QmqTimeoutError",
    "ReceivedMessage",
    "SendError",
]
