"""The asyncio SDK: ``from qmq.aio import Producer, Consumer, Message``.

The blocking SDK (``from qmq import Producer, Consumer``) has the same shape over these.
"""

from qmq.client.consumer import Consumer, PullConsumer
from qmq.client.message import Message
from qmq.client.producer import Producer
from qmq.client.received import Batch, ReceivedMessage
from qmq.client.sender import ProducerStats

__all__ = ["Batch", "Consumer", "Message", "Producer", "ProducerStats", "PullConsumer", "ReceivedMessage"]
