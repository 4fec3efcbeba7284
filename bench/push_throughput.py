"""HTTP push: deliveries a second from one gateway to a local endpoint, and the gap a `kill -9`
of the gateway running a subscription leaves (issue 19).

A fresh `qmq standalone` (its gateway runs the subscription) and an aiohttp endpoint in this
process answering 200 at once. The subject is filled with N messages of 1 KiB first, then
`qmq push add --from earliest` with the concurrency asked; the rate is N - 1 over the time from
the first delivery to the last. Then one more `qmq gateway` is started, the gateway holding the lease
is killed with SIGKILL while messages keep coming (20 a second), and the gap is the time from
the kill to the next delivery (the lease is 6 s, renewed every 2 s).

    .venv/bin/python -m bench.push_throughput [--messages 10000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import uvloop
from aiohttp import web

from qmq.aio import Producer
from qmq.testing import running_gateway, running_standalone

_LIMIT_S = 600.0


def _push(*args: str, meta_server: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "qmq", "push", *args, "--meta-server", meta_server],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def _holder(meta_server: str) -> str | None:
    for s in json.loads(_push("list", "--json", meta_server=meta_server))["subscriptions"]:
        if s["leased"]:
            return str(s["owner"])
    return None


async def run(messages: int, concurrency: int) -> None:
    arrivals: list[float] = []
    got = asyncio.Event()

    async def hook(request: web.Request) -> web.Response:
        await request.read()
        arrivals.append(time.monotonic())
        got.set()
        return web.Response(status=200)

    app = web.Application()
    app.router.add_post("/hook", hook)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", 0).start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}/hook"
    with tempfile.TemporaryDirectory() as tmp, running_standalone(Path(tmp) / "qmq-data") as proc:
        meta = proc.meta_server
        async with Producer(app_code="bench", meta_server=meta) as producer:
            pending = []
            for _ in range(messages):
                m = producer.generate_message("bench.push")
                m.body = b"x" * 1024
                pending.append(producer.send_nowait(m))
            await asyncio.gather(*pending)
            t0 = time.monotonic()
            await asyncio.to_thread(
                _push,
                "add", "bench.push", "--group", "g", "--url", url, "--from", "earliest",
                "--concurrency", str(concurrency), meta_server=meta,
            )  # fmt: skip
            deadline = t0 + _LIMIT_S
            while len(arrivals) < messages and time.monotonic() < deadline:
                got.clear()
                await asyncio.wait_for(got.wait(), _LIMIT_S)
            steady_s = arrivals[-1] - arrivals[0]
            print(
                f"push: {len(arrivals):,} deliveries of 1 KiB, concurrency {concurrency}: "
                f"first {arrivals[0] - t0:.2f} s after `push add` started (the command, then the gateway's "
                "next lease renewal), then "
                f"{(len(arrivals) - 1) / steady_s:,.0f} deliveries/s"
            )
            with running_gateway(meta):
                owner = await asyncio.to_thread(_holder, meta)
                assert owner is not None
                pid = int(owner.rsplit("-gateway-", 1)[1].split("-")[0])
                os.kill(pid, signal.SIGKILL)
                killed = time.monotonic()
                before = len(arrivals)
                while len(arrivals) == before and time.monotonic() - killed < 60:
                    await producer.send(producer.generate_message("bench.push"))
                    await asyncio.sleep(0.05)  # a trickle of 20 messages a second during the takeover
                print(f"takeover: {arrivals[before] - killed:.2f} s from kill -9 of the gateway to the next delivery")
    await runner.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=10_000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    uvloop.run(run(args.messages, args.concurrency))


if __name__ == "__main__":
    main()
