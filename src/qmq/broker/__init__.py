"""The realtime broker: an asyncio server over the store, with group commit, long-poll pulls,
acks, metrics and registration with the meta server."""

from qmq.broker.server import BrokerServer, run_broker

__all__ = ["BrokerServer", "run_broker"]
