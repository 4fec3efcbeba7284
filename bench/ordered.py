"""Ordered consumption (issue 20): how it scales with consumers, and what ordering costs.

Two parts, each on a fresh `qmq standalone` (flush = sync):

1. handler-bound: one subject filled with ``--keys`` order keys × ``--per-key`` messages, then
   drained by 1, 2, 4 and 8 consumer processes of a new ordered group each (a listener with
   ``ordered=True``, ``--concurrency`` handlers at once, each ``--handler-ms`` long). The clock
   starts when every consumer of the cell is connected and told to go, and stops when every
   message was handled. Speed-up is against 1 consumer.
2. CPU-bound: one consumer in this process drains ``--drain-messages`` (keys × messages) with
   an empty handler, once with an ordered listener and once with a plain one; the drop is the
   cost of ordering (dispatch by slot on the broker, per-key queues in the SDK).

    .venv/bin/python -m bench.ordered [--keys 10000] [--per-key 2] [--handler-ms 2] [--concurrency 1]
        [--consumers 1,2,4,8] [--repeats 1] [--rabbitmq amqp://guest:guest@127.0.0.1:5672/%2F]

``--repeats N`` runs each cell N times and shows the median (the machine is shared: one slow or
one lucky run must not move a figure).

With ``--rabbitmq URL`` the handler-bound cells also run on that RabbitMQ, as single-active-
consumer queues, one per slot group (``bench.ordered_rabbitmq``: how, and what it needs that qmq
does not: a queue count fixed ahead, its queues assigned to consumers by hand).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.testing import running_standalone
from qmq.testing.processes import start_ready

_CELL_LIMIT_S = 600.0
SUBJECT = "bench.ordered"


async def fill(meta_server: str, subject: str, keys: int, per_key: int) -> float:
    """Send keys × per_key ordered messages (100-byte bodies); returns msgs/s of the send."""
    t0 = time.perf_counter()
    async with Producer(app_code="bench", meta_server=meta_server, send_timeout_ms=120_000) as producer:
        for n in range(per_key):
            pending = []
            for i in range(keys):
                m = producer.generate_message(subject)
                m.set_order_key(f"key-{i}")
                m.body = f"{n:03d}".encode() + b"x" * 97
                pending.append(producer.send_nowait(m))
                if len(pending) >= 5000:
                    await asyncio.gather(*pending)
                    pending = []
            await asyncio.gather(*pending)
    return keys * per_key / (time.perf_counter() - t0)


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _write_count(path: str, count: int) -> None:
    with open(path, "w") as f:
        f.write(str(count))


async def worker(
    meta_server: str, group: str, go: str, out: str, handler_ms: float, concurrency: int, ordered: bool
) -> None:
    """A consumer process of part 1: waits for ``go`` to exist, then handles, counting into ``out``."""
    stop = asyncio.Event()
    asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
    count = 0

    async def handle(_m: ReceivedMessage) -> None:
        nonlocal count
        await asyncio.sleep(handler_ms / 1000)
        count += 1

    async with Consumer(app_code="bench", meta_server=meta_server, consumer_id=Path(out).stem) as consumer:
        print("qmq ready role=bench-ordered-worker", flush=True)
        while not _exists(go):  # noqa: ASYNC110 -- the cell's start is a file another process makes
            await asyncio.sleep(0.01)
        consumer.add_listener(
            SUBJECT, group, handle, start_from="earliest", ordered=ordered, concurrency=concurrency, prefetch=512
        )
        while not stop.is_set():
            _write_count(out, count)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
        _write_count(out, count)


def run_cell(meta_server: str, consumers: int, total: int, args: argparse.Namespace, tmp: Path, ordered: bool) -> float:
    """Seconds for ``consumers`` processes of a new (ordered) group to handle ``total`` messages."""
    group = f"g{consumers}-{uuid.uuid4().hex[:6]}"
    go = tmp / f"{group}.go"
    outs = [tmp / f"{group}-c{i}.count" for i in range(consumers)]
    procs = [
        start_ready(
            [
                sys.executable,
                "-m",
                "bench.ordered",
                "--worker",
                meta_server,
                group,
                str(go),
                str(out),
                str(args.handler_ms),
                str(args.concurrency),
                "ordered" if ordered else "unordered",
            ]
        )
        for out in outs
    ]
    try:
        go.touch()
        t0 = time.perf_counter()
        while True:
            done = sum(int(o.read_text() or 0) for o in outs if o.exists())
            if done >= total:
                return time.perf_counter() - t0
            if time.perf_counter() - t0 > _CELL_LIMIT_S:
                raise RuntimeError(f"{consumers} consumers handled {done} of {total} in {_CELL_LIMIT_S} s")
            time.sleep(0.02)  # polling the workers' counts
    finally:
        for p in procs:
            p.stop()


async def drain(meta_server: str, subject: str, total: int, ordered: bool) -> float:
    """msgs/s of one consumer draining ``subject`` with an empty handler."""
    done = asyncio.Event()
    count = 0

    async def handle(_m: ReceivedMessage) -> None:
        nonlocal count
        count += 1
        if count == total:
            done.set()

    async with Consumer(app_code="bench", meta_server=meta_server) as consumer:
        t0 = time.perf_counter()
        consumer.add_listener(
            subject,
            f"d-{uuid.uuid4().hex[:6]}",
            handle,
            start_from="earliest",
            ordered=ordered,
            concurrency=32,
            prefetch=2000,
        )
        await asyncio.wait_for(done.wait(), _CELL_LIMIT_S)
        return total / (time.perf_counter() - t0)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        meta_server, group, go, out, handler_ms, concurrency, mode = sys.argv[2:9]
        asyncio.run(worker(meta_server, group, go, out, float(handler_ms), int(concurrency), mode == "ordered"))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--per-key", type=int, default=2)
    ap.add_argument("--handler-ms", type=float, default=2.0)
    ap.add_argument("--concurrency", type=int, default=1, help="handlers at once in each consumer")
    ap.add_argument("--consumers", default="1,2,4,8")
    ap.add_argument("--drain-keys", type=int, default=10_000)
    ap.add_argument("--drain-per-key", type=int, default=5)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each cell; the median is shown")
    ap.add_argument("--rabbitmq", metavar="URL", help="also run the handler-bound cells on this RabbitMQ")
    ap.add_argument("--rabbitmq-queues", type=int, default=16, help="single-active-consumer queues (slot groups)")
    args = ap.parse_args()
    total = args.keys * args.per_key
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}; qmq standalone, flush = sync")
    with tempfile.TemporaryDirectory() as d, running_standalone(Path(d) / "qmq") as sa:
        tmp = Path(d)
        rate = asyncio.run(fill(sa.meta_server, SUBJECT, args.keys, args.per_key))
        print(f"\nfill: {total} ordered messages ({args.keys} keys) sent at {rate:,.0f} msgs/s")
        print(f"\nhandler-bound: {args.handler_ms} ms a message, {args.concurrency} handler(s) at once a consumer")
        print("(unordered: the same cell with a plain listener, the machine's own ceiling for this load)")
        print("| consumers | ordered s | msgs/s | speed-up | unordered s | msgs/s | speed-up |")
        print("|---|---|---|---|---|---|---|")
        base: dict[bool, float] = {}
        for n in [int(x) for x in args.consumers.split(",")]:
            row = [str(n)]
            for ordered in (True, False):
                runs = [run_cell(sa.meta_server, n, total, args, tmp, ordered) for _ in range(args.repeats)]
                seconds = statistics.median(runs)
                if args.repeats > 1:
                    print(f"({n} {'ordered' if ordered else 'unordered'}: {', '.join(f'{r:.2f}' for r in runs)} s)")
                base.setdefault(ordered, seconds)
                row += [f"{seconds:.2f}", f"{total / seconds:,.0f}", f"{base[ordered] / seconds:.2f}x"]
            print("| " + " | ".join(row) + " |", flush=True)
        drain_subject = "bench.drain"
        drain_total = args.drain_keys * args.drain_per_key
        asyncio.run(fill(sa.meta_server, drain_subject, args.drain_keys, args.drain_per_key))
        print(f"\nCPU-bound drain, one consumer, empty handler, {drain_total} messages ({args.drain_keys} keys)")
        print("| listener | msgs/s |\n|---|---|")
        for ordered in (False, True):
            r = statistics.median(
                asyncio.run(drain(sa.meta_server, drain_subject, drain_total, ordered)) for _ in range(args.repeats)
            )
            print(f"| {'ordered' if ordered else 'unordered'} | {r:,.0f} |", flush=True)
    if args.rabbitmq:
        from bench.ordered_rabbitmq import run as run_rabbitmq  # pika: only when asked for

        counts = [int(x) for x in args.consumers.split(",")]
        run_rabbitmq(
            args.rabbitmq, args.keys, args.per_key, args.handler_ms, counts, args.rabbitmq_queues, args.repeats
        )


if __name__ == "__main__":
    main()
