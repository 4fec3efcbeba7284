"""The HTTP gateway role (``qmq gateway``): HTTP/1.1 and JSON in front of the asyncio SDK, so
any language can send and consume with the SDK's routing, failover, retries, delay and dedup.

It keeps no data: any number of gateways can run behind a load balancer. It imports the SDK
(``qmq.client``), ``qmq.common`` and ``qmq.protocol`` only, never a server's code. The routes
are described in ``docs/gateway.md`` and by ``GET /openapi.json``.
"""

from qmq.gateway.server import Gateway, GatewayServer, run_gateway

__all__ = ["Gateway", "GatewayServer", "run_gateway"]
