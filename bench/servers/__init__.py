"""Servers the harness starts for itself: loopback only, data in a temp dir, stopped by PID."""

from __future__ import annotations

from bench.servers.base import ServerProcess, StartError
from bench.servers.nats import NatsServer
from bench.servers.qmq import QmqServer
from bench.servers.rabbitmq import RabbitMqServer
from bench.servers.redis import RedisServer
from bench.settings import Settings

__all__ = ["ServerProcess", "StartError", "make_server"]


def make_server(system: str, data_root: str, settings: Settings) -> ServerProcess:
    """The server of one system: a peer name or `qmq-<flush policy>`."""
    if system.startswith("qmq-"):
        return QmqServer(data_root, flush=system.removeprefix("qmq-"), settings=settings)
    if system == "rabbitmq":
        return RabbitMqServer(data_root, settings)
    if system == "nats":
        return NatsServer(data_root, settings)
    if system == "redis":
        return RedisServer(data_root, settings)
    raise ValueError(f"unknown system {system!r}: expected qmq-sync, qmq-periodic, rabbitmq, nats or redis")
