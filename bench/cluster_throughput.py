"""Send throughput of a cluster with one broker group vs two (each a master and a slave,
`wait_slave_wrote` on: a send is acknowledged once the slave has it), started with
`qmq cluster up`.

    .venv/bin/python -m bench.cluster_throughput [--messages 100000] [--subjects 8]
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop

from qmq.aio import Producer

_WINDOW = 2000
_BODY = b"x" * 1024


async def produce(meta_server: str, n: int, subjects: int) -> float:
    async with Producer(app_code="bench", meta_server=meta_server) as producer:
        names = [f"bench.cluster.{i}" for i in range(subjects)]
        for name in names:  # routes looked up before the clock starts
            await producer.send(producer.generate_message(name))
        pending: list[asyncio.Future[None]] = []
        t0 = time.perf_counter()
        for i in range(n):
            m = producer.generate_message(names[i % subjects])
            m.body = _BODY
            pending.append(producer.send_nowait(m))
            if len(pending) >= _WINDOW:
                await asyncio.gather(*pending[: _WINDOW // 2])
                del pending[: _WINDOW // 2]
        await asyncio.gather(*pending)
        return n / (time.perf_counter() - t0)


def run(groups: int, n: int, subjects: int) -> float:
    qmq = [sys.executable, "-m", "qmq"]
    with tempfile.TemporaryDirectory(prefix="qmq-cluster-bench-") as tmp:
        data = Path(tmp) / "cluster"
        up = subprocess.run(
            [
                *qmq,
                "cluster",
                "up",
                "--broker-groups",
                str(groups),
                "--slaves",
                "1",
                "--delay-groups",
                "0",
                "--data-dir",
                str(data),
            ],
            capture_output=True,
            text=True,
            timeout=120,
            check=True,
        )
        line = next(x for x in up.stdout.splitlines() if x.startswith("qmq ready"))
        meta_server = next(p.split("=", 1)[1] for p in line.split() if p.startswith("meta_server="))
        try:
            return uvloop.run(produce(meta_server, n, subjects))
        finally:
            subprocess.run([*qmq, "cluster", "down", "--data-dir", str(data)], capture_output=True, timeout=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--subjects", type=int, default=8)
    args = parser.parse_args()
    for groups in (1, 2):
        rate = run(groups, args.messages, args.subjects)
        print(f"{groups} broker group(s), 1 slave each: {rate:,.0f} msg/s ({args.messages:,} x 1 KiB, sync flush)")


if __name__ == "__main__":
    main()
