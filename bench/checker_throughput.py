"""Consume throughput of a listener with and without an idempotent checker (issue 5).

Fills one subject of a fresh `qmq standalone` with N messages, then drains it with an
asyncio listener (concurrency 32) once per checker: none, memory, Redis (127.0.0.1:6379).
Prints msgs/s per row; the checker's cost is the drop against the "none" row.

    .venv/bin/python -m bench.checker_throughput [--messages 50000]
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import uvloop

from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.idempotency import MemoryIdempotentChecker
from qmq.testing import running_standalone

_DRAIN_LIMIT_S = 300.0


async def fill(meta_server: str, subject: str, n: int) -> None:
    async with Producer(app_code="bench", meta_server=meta_server) as producer:
        pending = []
        for i in range(n):
            m = producer.generate_message(subject)
            m.body = b"x" * 1024
            pending.append(producer.send_nowait(m))
            if len(pending) >= 2000 or i == n - 1:
                await asyncio.gather(*pending)
                pending = []


async def drain(meta_server: str, subject: str, n: int, checker: Any) -> float:
    done = asyncio.Event()
    count = 0

    async def on_message(_m: ReceivedMessage) -> None:
        nonlocal count
        count += 1
        if count == n:
            done.set()

    async with Consumer(app_code="bench", meta_server=meta_server) as consumer:
        t0 = time.perf_counter()
        consumer.add_listener(
            subject,
            f"g-{uuid.uuid4().hex[:6]}",
            on_message,
            start_from="earliest",
            concurrency=32,
            prefetch=2000,
            idempotent_checker=checker,
        )
        await asyncio.wait_for(done.wait(), _DRAIN_LIMIT_S)
        return n / (time.perf_counter() - t0)


async def main(meta_server: str, n: int) -> None:
    subject = f"bench.checker.{uuid.uuid4().hex[:6]}"
    await fill(meta_server, subject, n)
    checkers: list[tuple[str, Any]] = [("none", None), ("memory", MemoryIdempotentChecker(max_entries=4 * n))]
    try:
        import redis.asyncio as aioredis

        from qmq.idempotency import AsyncRedisIdempotentChecker

        client = aioredis.Redis(host="127.0.0.1", port=6379)
        await client.ping()
        checkers.append(("redis", AsyncRedisIdempotentChecker(client, prefix=f"bench:{uuid.uuid4().hex[:6]}:")))
    except Exception as exc:  # Redis is optional for this bench: say why the row is missing
        print(f"redis row skipped: {exc}")
    print(f"listener drain of {n:,} messages of 1 KiB, concurrency 32")
    for name, checker in checkers:
        rate = await drain(meta_server, subject, n, checker)
        print(f"  checker={name:<7} {rate:>10,.0f} msg/s")


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=50_000)
    args = parser.parse_args()
    with (
        tempfile.TemporaryDirectory(prefix="qmq-checker-bench-") as tmp,
        running_standalone(Path(tmp) / "data") as proc,
    ):
        uvloop.run(main(proc.meta_server, args.messages))


if __name__ == "__main__":
    cli()
