"""W8: the HTTP gateway beside the native SDK, on qmq's server of the run (issue 19's cell).

One process (``python -m bench.gateway_throughput --meta-server ...``) publishes and drains
``w8_messages`` with the asyncio SDK (``w8_connections`` batches of 100 in flight) and the same
over HTTP through the standalone's gateway in batches of 100 from ``w8_connections`` keep-alive
connections, ``w8_rounds`` times, alternating which goes first; it reports the medians of the
four rates, of the gateway's CPU per 100k messages (publish, drain) and of the ratios. Goal: HTTP publish at least half
the SDK's rate. Peers have no gateway: their rows say so.
"""

from __future__ import annotations

from typing import Any

from bench.cell import Cell, CellError

# Slowest HTTP rate we still wait for, to turn the message count into a time limit.
_SLOWEST_MSGS_PER_S = 1_000


def w8_gateway(cell: Cell, family: str) -> dict[str, Any]:
    s = cell.settings
    gateway, gateway_pid = cell.endpoint.get("gateway"), cell.endpoint.get("gateway_pid")
    if not gateway or not gateway_pid:
        raise CellError("the qmq server of the run printed no gateway=URL gateway_pid=N")
    limit_s = cell.worker_limit_s(4 * s.w8_rounds * s.w8_messages / _SLOWEST_MSGS_PER_S)
    args = [
        "--meta-server", cell.endpoint["meta_server"], "--gateway", gateway, "--gateway-pid", str(gateway_pid),
        "--messages", str(s.w8_messages), "--connections", str(s.w8_connections),
        "--in-flight", str(s.w8_connections), "--rounds", str(s.w8_rounds), "--subject-prefix", family,
    ]  # fmt: skip
    result, server = cell.run_bench("bench.gateway_throughput", args, limit_s, "the gateway cell",
                                    4 * s.w8_rounds * s.w8_messages)
    return {**result, "server": server}
