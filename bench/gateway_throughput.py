"""The gateway cell: publish and drain over HTTP in batches of 100 beside the native SDK, and
the gateway process's CPU per 100,000 messages (issue 19; goal: HTTP publish at least half the
SDK's rate).

One fresh `qmq standalone` (`flush = "sync"`: every answer after its fsync), 1 KiB bodies, the
same message count for each row, each row on a subject of its own:

- sdk publish: one `qmq.aio` producer, `send_nowait` with up to `--in-flight` batches of 100
  outstanding (16, as many as the HTTP clients: one window for both paths); the rate is
  messages over the time until the last is acknowledged.
- http publish: `--connections` keep-alive HTTP clients (aiohttp, in this process), each POSTing
  `{"messages": [100 messages]}` and waiting for its answer before the next.
- sdk drain: a pull consumer, pulls of 100, `ack_all` each, the last acks flushed.
- http drain: `--connections` clients each pulling 100 and POSTing their receipts to /v1/acks
  (answered once the broker recorded them) before the next pull.

The four rows run `--rounds` times (3), which path goes first alternating from round to round;
the figures are the medians (each round's are in the JSON). The gateway's CPU is read from
/proc before and after each HTTP row (user + system of its process). The clients run in this
process, so the machine's two cores are shared by the client, the gateway and the broker, as
on a one-box deployment.

    .venv/bin/python -m bench.gateway_throughput [--messages 100000] [--connections 16] [--pull-consumers 4]

`python -m bench run` runs it as its W8 cell against the qmq server of the run (``--meta-server``,
``--gateway`` and ``--gateway-pid`` name it; ``--subject-prefix`` keeps each cell's subjects apart).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from bench.procfs import cpu_seconds
from qmq.aio import Consumer, Producer
from qmq.testing import running_standalone

BATCH = 100
BODY = "x" * 1024
_LIMIT_S = 900.0


async def _sdk_publish(meta: str, subject: str, n: int, in_flight: int) -> float:
    async with Producer(app_code="bench", meta_server=meta) as producer:
        window: list[Awaitable[Any]] = []
        t0 = time.monotonic()
        for start in range(0, n, BATCH):
            futures = []
            for _ in range(min(BATCH, n - start)):
                m = producer.generate_message(subject)
                m.body = BODY
                futures.append(producer.send_nowait(m))
            window.append(asyncio.gather(*futures))
            if len(window) >= in_flight:
                await window.pop(0)
        await asyncio.gather(*window)
        return n / (time.monotonic() - t0)


async def _sdk_drain(meta: str, subject: str, n: int) -> float:
    async with Consumer(app_code="bench", meta_server=meta) as consumer:
        pc = consumer.pull_consumer(subject, "g", "earliest")
        got = 0
        t0 = time.monotonic()
        deadline = t0 + _LIMIT_S
        while got < n and time.monotonic() < deadline:
            batch = await pc.pull(BATCH, 1000)
            batch.ack_all()
            got += len(batch)
        await consumer.flush_acks()
        assert got >= n, f"sdk drained {got} of {n}"
        return n / (time.monotonic() - t0)


async def _http_publish(http: aiohttp.ClientSession, gw: str, subject: str, n: int, connections: int) -> float:
    batches = [min(BATCH, n - s) for s in range(0, n, BATCH)]
    url = f"{gw}/v1/subjects/{subject}/messages"

    # every batch of a size is the same document: encoded once, as the SDK rows reuse one body (an HTTP
    # client's JSON encoding is its own process's work, not the gateway's)
    docs = {size: json.dumps({"messages": [{"body": BODY}] * size}).encode() for size in set(batches)}
    headers = {"Content-Type": "application/json"}

    async def client() -> None:
        while batches:
            size = batches.pop()
            async with http.post(url, data=docs[size], headers=headers) as resp:
                doc = await resp.json()
                if resp.status != 200 or len(doc["results"]) != size:
                    raise RuntimeError(f"a batch of {size} was answered HTTP {resp.status}: {doc}")

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(connections)))
    return n / (time.monotonic() - t0)


async def _http_drain(http: aiohttp.ClientSession, gw: str, subject: str, n: int, connections: int) -> float:
    pull_url = f"{gw}/v1/subjects/{subject}/groups/g/pull"
    got = 0
    deadline = time.monotonic() + _LIMIT_S

    async def client() -> None:
        nonlocal got
        while got < n and time.monotonic() < deadline:
            # the backlog is there: no long poll, which would hold the group's pulls in line at the end
            body = {"max_messages": BATCH, "timeout_ms": 0, "start_from": "earliest"}
            async with http.post(pull_url, json=body) as resp:
                messages = (await resp.json())["messages"]
            got += len(messages)
            if messages:
                async with http.post(f"{gw}/v1/acks", json={"acks": [m["receipt"] for m in messages]}) as resp:
                    assert resp.status == 200, await resp.text()

    t0 = time.monotonic()
    await asyncio.gather(*(client() for _ in range(connections)))
    assert got >= n, f"http drained {got} of {n}"
    return n / (time.monotonic() - t0)


async def _cpu_of(pid: int, what: Callable[[], Awaitable[float]], n: int) -> tuple[float, float]:
    """(rate, the gateway's CPU seconds per 100k messages) of one HTTP row."""
    before = cpu_seconds(pid) or 0.0
    rate = await what()
    after = cpu_seconds(pid) or 0.0
    return rate, (after - before) * 100_000 / n


async def measure(
    meta: str,
    gw: str,
    gw_pid: int,
    messages: int,
    connections: int,
    in_flight: int,
    prefix: str = "bench.gw",
    rounds: int = 3,
) -> dict[str, Any]:
    """The four rows against a running server and its gateway, ``rounds`` times, each round on
    subjects of its own; which path goes first alternates from round to round (on a shared
    machine the load moves within seconds), and the figures are the medians."""
    runs: list[dict[str, float]] = []
    limits = aiohttp.TCPConnector(limit=connections)
    async with aiohttp.ClientSession(connector=limits, timeout=aiohttp.ClientTimeout(total=120)) as http:
        for r in range(rounds):
            row: dict[str, float] = {}
            sdk_subject, http_subject = f"{prefix}.sdk{r}", f"{prefix}.http{r}"

            async def sdk_publish(row: dict[str, float] = row, subject: str = sdk_subject) -> None:
                row["sdk_publish_per_s"] = await _sdk_publish(meta, subject, messages, in_flight)

            async def http_publish(row: dict[str, float] = row, subject: str = http_subject) -> None:
                rate, cpu = await _cpu_of(
                    gw_pid, lambda: _http_publish(http, gw, subject, messages, connections), messages
                )
                row["http_publish_per_s"], row["gateway_cpu_s_per_100k_publish"] = rate, cpu

            async def sdk_drain(row: dict[str, float] = row, subject: str = sdk_subject) -> None:
                row["sdk_drain_per_s"] = await _sdk_drain(meta, subject, messages)

            async def http_drain(row: dict[str, float] = row, subject: str = http_subject) -> None:
                rate, cpu = await _cpu_of(
                    gw_pid, lambda: _http_drain(http, gw, subject, messages, connections), messages
                )
                row["http_drain_per_s"], row["gateway_cpu_s_per_100k_drain"] = rate, cpu

            steps = [sdk_publish, http_publish, sdk_drain, http_drain]
            if r % 2:
                steps = [http_publish, sdk_publish, http_drain, sdk_drain]
            for step in steps:
                await step()
            row["publish_ratio"] = row["http_publish_per_s"] / row["sdk_publish_per_s"]
            row["drain_ratio"] = row["http_drain_per_s"] / row["sdk_drain_per_s"]
            runs.append(row)
    out: dict[str, Any] = {
        "messages": messages,
        "body_bytes": len(BODY),
        "batch": BATCH,
        "connections": connections,
        "in_flight_batches": in_flight,
        "rounds": rounds,
    }
    out.update({key: statistics.median(run[key] for run in runs) for key in runs[0]})
    out["runs"] = runs
    return out


async def run(messages: int, connections: int, in_flight: int, pull_consumers: int, rounds: int) -> dict[str, Any]:
    """The cell against a fresh `qmq standalone` of its own (flush = "sync")."""
    config = {"gateway": {"pull_consumers": pull_consumers}}
    with tempfile.TemporaryDirectory() as tmp, running_standalone(Path(tmp) / "qmq-data", config) as proc:
        out = await measure(
            proc.meta_server, proc.gateway, int(proc.ready["gateway_pid"]), messages, connections, in_flight,
            rounds=rounds,
        )  # fmt: skip
    return {**out, "flush": "sync", "pull_consumers": pull_consumers}


def table(r: dict[str, Any]) -> str:
    return "\n".join(
        [
            f"gateway cell: {r['messages']:,} messages of {r['body_bytes']} B, batches of {r['batch']}, "
            f"medians of {r['rounds']} rounds, {r['in_flight_batches']} SDK batches in flight, "
            f"{r['connections']} HTTP connections, {r.get('pull_consumers', '?')} pull consumers, "
            f"flush = {r.get('flush', '?')}",
            "",
            "| path | publish msg/s | drain msg/s | gateway CPU s / 100k (publish, drain) |",
            "|---|---|---|---|",
            f"| native SDK (qmq.aio) | {r['sdk_publish_per_s']:,.0f} | {r['sdk_drain_per_s']:,.0f} | — |",
            f"| HTTP gateway | {r['http_publish_per_s']:,.0f} | {r['http_drain_per_s']:,.0f} | "
            f"{r['gateway_cpu_s_per_100k_publish']:.1f}, {r['gateway_cpu_s_per_100k_drain']:.1f} |",
            f"| gateway ÷ SDK | {r['publish_ratio']:.2f} (goal ≥ 0.50) | {r['drain_ratio']:.2f} | |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--connections", type=int, default=16)
    parser.add_argument(
        "--in-flight",
        type=int,
        default=16,
        help="SDK batches of 100 outstanding at once (as --connections: one window)",
    )
    parser.add_argument("--pull-consumers", type=int, default=4, help="the gateway's pull_consumers")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document too")
    parser.add_argument("--meta-server", help="measure this running server (with --gateway, --gateway-pid)")
    parser.add_argument("--gateway", help="the running server's gateway URL")
    parser.add_argument("--gateway-pid", type=int, help="the running server's gateway process")
    parser.add_argument("--subject-prefix", default="bench.gw")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the four rows; the medians are reported")
    args = parser.parse_args()
    if args.meta_server:
        if not args.gateway or not args.gateway_pid:
            parser.error("--meta-server needs --gateway URL and --gateway-pid N")
        result = uvloop.run(
            measure(
                args.meta_server, args.gateway, args.gateway_pid, args.messages, args.connections, args.in_flight,
                args.subject_prefix, args.rounds,
            )
        )  # fmt: skip
        print(json.dumps(result))  # the W8 cell of `python -m bench run` reads this line
        return
    result = uvloop.run(run(args.messages, args.connections, args.in_flight, args.pull_consumers, args.rounds))
    print(table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
