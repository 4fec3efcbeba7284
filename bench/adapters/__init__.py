"""One adapter per system, all with the same shape (see base.Adapter). Imported lazily:
a worker loads only its own system's client library."""

from __future__ import annotations

from typing import Any

from bench.adapters.base import Adapter
from bench.settings import Settings

__all__ = ["Adapter", "make_adapter"]


def make_adapter(system: str, endpoint: dict[str, Any], settings: Settings) -> Adapter:
    if system.startswith("qmq-"):
        from bench.adapters.qmq import QmqAdapter

        return QmqAdapter(endpoint, settings)
    if system == "rabbitmq":
        from bench.adapters.rabbitmq import RabbitMqAdapter

        return RabbitMqAdapter(endpoint, settings)
    if system == "nats":
        from bench.adapters.nats import NatsAdapter

        return NatsAdapter(endpoint, settings)
    if system == "redis":
        from bench.adapters.redis import RedisAdapter

        return RedisAdapter(endpoint, settings)
    raise ValueError(f"unknown system {system!r}")
