"""Background services of a gateway process: work that runs beside the HTTP routes (the
sweeper of expired receipts, HTTP push) with the same lifetime as the server.

A service is started once the HTTP server serves and stopped, in reverse order, before it
closes; ``background_services`` lists them, so a new one is one line there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from qmq.gateway.push import PushService

if TYPE_CHECKING:
    from qmq.gateway.server import Gateway


class BackgroundService(Protocol):
    """Something a gateway runs in the background: ``start`` returns once it runs (its loops as
    tasks of its own), ``stop`` once they ended; neither raises for a failure of one item."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...


def background_services(gateway: Gateway) -> list[BackgroundService]:
    """The services of ``gateway``, in start order."""
    config = gateway.config
    return [
        gateway.receipts,
        gateway.transforms,
        PushService(
            config.meta_server,
            app_code=config.app_code,
            lease_ms=config.push_lease_ms,
            held_max=config.push_subscriptions_max,
            ssl=gateway.tls_out,
            transforms=gateway.transforms,
        ),
    ]
