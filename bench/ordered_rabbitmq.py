"""The peer of bench.ordered's handler-bound cells: RabbitMQ single-active-consumer queues.

RabbitMQ keeps order per queue, and a queue declared with ``x-single-active-consumer`` delivers
to one of its consumers at a time (the first that subscribed; the others stand by and take over
when it leaves). Per-key order over many consumers is then "one queue per slot group": a fixed
number of queues (``--rabbitmq-queues``, 16), a key's messages routed to queue
``crc32(key) % queues`` (the routing a consistent-hash exchange would do, without its plugin,
which Debian does not package), and each consumer subscribed to every queue.

RabbitMQ 3.10 does not spread single-active-consumer queues over their consumers: the first
subscriber of a queue keeps it. So each consumer process subscribes first to its own share of
the queues (queue ``q`` is consumer ``q % consumers``'s), and to the others, as a standby, only
once every consumer holds its share: the assignment by hand that a fixed queue count needs, and
that qmq's slots do by themselves. The queue count also caps the consumers that can work (16
here: a 17th would only stand by) and must divide evenly among them, or some work more.

Same load as qmq's cell: ``keys`` × ``per_key`` 100-byte persistent messages on durable quorum
queues (fsynced, like qmq's flush = sync), one handler at a time in each consumer process
(``time.sleep`` of ``handler_ms``), a prefetch of 512 per consumer, each message acked once
handled. The clock starts when every consumer process is connected and told to go, and stops
when every message was handled. With ``--server-pids`` (the node's processes) each cell also
reports the node's CPU per 100k messages handled (the fill's left out).

    .venv/bin/python -m bench.ordered_rabbitmq [--url amqp://guest:guest@127.0.0.1:5672/%2F] [--json]

`python -m bench run` runs it as the RabbitMQ row of its W12 cell ("ordered"), on the run's own
private node (``--url`` with its port, ``--server-pids``, ``--json``).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
import zlib
from pathlib import Path
from typing import Any

import pika  # type: ignore[import-untyped]

from bench.ordered import figures, scaled, server_cpu_s, wait_handled
from qmq.testing.processes import start_ready

DEFAULT_URL = "amqp://guest:guest@127.0.0.1:5672/%2F"
_FILL_LIMIT_S = 300.0


def queue_names(prefix: str, queues: int) -> list[str]:
    return [f"{prefix}.q{q:02d}" for q in range(queues)]


def queue_of(key: str, queues: int) -> int:
    """The queue of an order key: CRC32 of its UTF-8 bytes, as qmq's slots (qmq.common.ordering)."""
    return zlib.crc32(key.encode()) % queues


def declare(channel: object, names: list[str]) -> None:
    args = {"x-queue-type": "quorum", "x-single-active-consumer": True}
    for name in names:
        channel.queue_declare(name, durable=True, arguments=args)  # type: ignore[attr-defined]


def fill(url: str, names: list[str], keys: int, per_key: int) -> float:
    """Publish keys × per_key persistent messages, each to its key's queue; returns msgs/s (until
    every queue holds its messages: no publisher confirms, the queue depths say it)."""
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        declare(ch, names)
        props = pika.BasicProperties(delivery_mode=pika.DeliveryMode.Persistent)
        t0 = time.perf_counter()
        for n in range(per_key):
            for i in range(keys):
                key = f"key-{i}"
                body = f"{n:03d}".encode() + b"x" * 97
                ch.basic_publish("", names[queue_of(key, len(names))], body, props)
            conn.process_data_events(0)
        total = keys * per_key
        while True:
            held = sum(ch.queue_declare(name, passive=True).method.message_count for name in names)
            if held >= total:
                return total / (time.perf_counter() - t0)
            if time.perf_counter() - t0 > _FILL_LIMIT_S:
                raise RuntimeError(f"RabbitMQ holds {held} of {total} messages after {_FILL_LIMIT_S} s")
            conn.process_data_events(0.05)  # bounded by the deadline above
    finally:
        conn.close()


def worker(
    url: str, prefix: str, queues: int, index: int, consumers: int, go: str, out: str, handler_ms: float
) -> None:
    """A consumer process: subscribes to its share of the queues, then (every consumer holding its
    share) to the others as a standby; handles one message at a time, counting into ``out``."""
    stopping = False

    def stop(_sig: int, _frame: object) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    names = queue_names(prefix, queues)
    conn = pika.BlockingConnection(pika.URLParameters(url))
    ch = conn.channel()
    ch.basic_qos(prefetch_count=512)
    count = 0

    def handle(channel: object, method: object, _props: object, _body: bytes) -> None:
        nonlocal count
        time.sleep(handler_ms / 1000)
        count += 1
        channel.basic_ack(method.delivery_tag)  # type: ignore[attr-defined]

    print("qmq ready role=bench-ordered-rabbitmq-worker", flush=True)
    while not os.path.exists(go):
        time.sleep(0.01)  # the cell's start is a file another process makes
    own = [q for q in range(queues) if q % consumers == index]
    for q in own:
        ch.basic_consume(names[q], handle)
    Path(f"{out}.primary").touch()
    others = [Path(out).with_name(Path(out).name.replace(f"-c{index}.", f"-c{i}.")) for i in range(consumers)]
    deadline = time.monotonic() + 60
    while not all(Path(f"{o}.primary").exists() for o in others) and time.monotonic() < deadline:
        conn.process_data_events(0.01)  # deliveries of its own queues go on meanwhile
    for q in range(queues):
        if q not in own:
            ch.basic_consume(names[q], handle)  # a standby: active only if the owner leaves
    while not stopping:
        Path(out).write_text(str(count))
        conn.process_data_events(0.05)
    Path(out).write_text(str(count))
    with contextlib.suppress(Exception):
        conn.close()


def run_cell(
    url: str, names: list[str], prefix: str, consumers: int, total: int, handler_ms: float, tmp: Path
) -> float:
    """Seconds for ``consumers`` processes to handle ``total`` messages of the queues."""
    cell = f"r{consumers}-{uuid.uuid4().hex[:6]}"
    go = tmp / f"{cell}.go"
    outs = [tmp / f"{cell}-c{i}.count" for i in range(consumers)]
    argv = [sys.executable, "-m", "bench.ordered_rabbitmq", "--worker", url, prefix, str(len(names))]
    procs = [
        start_ready([*argv, str(i), str(consumers), str(go), str(out), str(handler_ms)]) for i, out in enumerate(outs)
    ]
    try:
        go.touch()
        return wait_handled(outs, total, consumers)
    finally:
        for p in procs:
            p.stop()


def delete(url: str, names: list[str]) -> None:
    conn = pika.BlockingConnection(pika.URLParameters(url))
    try:
        ch = conn.channel()
        for name in names:
            ch.queue_delete(name)
    finally:
        conn.close()


def measure(
    url: str,
    keys: int,
    per_key: int,
    handler_ms: float,
    consumer_counts: list[int],
    queues: int,
    repeats: int = 1,
    pids: list[int] | None = None,
) -> dict[str, Any]:
    """The handler-bound cells on RabbitMQ single-active-consumer queues (a fresh set of queues
    filled for each run of a cell; medians of ``repeats`` runs); the server's CPU per 100k
    messages handled when ``pids`` names its processes."""
    total, pids = keys * per_key, pids or []
    cells: dict[str, Any] = {}
    fills: list[float] = []
    with tempfile.TemporaryDirectory() as d:
        for n in consumer_counts:
            runs: list[tuple[float, float]] = []  # (seconds, the server's CPU seconds) of each run
            for _ in range(repeats):
                prefix = f"bench.ordered.{uuid.uuid4().hex[:6]}"
                names = queue_names(prefix, queues)
                try:
                    fills.append(fill(url, names, keys, per_key))
                    cpu0 = server_cpu_s(pids)
                    seconds = run_cell(url, names, prefix, n, total, handler_ms, Path(d))
                    runs.append((seconds, server_cpu_s(pids) - cpu0))
                finally:
                    delete(url, names)
            scaled(cells, n, figures(runs, total, pids))
            print(f"{n} RabbitMQ SAC: {cells[str(n)]}", file=sys.stderr, flush=True)
    return {
        "url_host": url.rsplit("@", 1)[-1], "queues": queues, "keys": keys, "per_key": per_key, "messages": total,
        "handler_ms": handler_ms, "consumers": consumer_counts, "repeats": repeats,
        "fill_msgs_per_s": round(statistics.median(fills), 1), "handler_bound": cells,
    }  # fmt: skip


def table(r: dict[str, Any]) -> str:
    lines = [
        f"RabbitMQ {r['url_host']}: {r['queues']} single-active-consumer quorum queues, each consumer",
        f"subscribed to its share first and to the rest as a standby; {r['handler_ms']} ms a message, 1 at a time",
        f"(fill: {r['fill_msgs_per_s']:,.0f} msgs/s, no confirms, until the queue depths held every message)",
        "| consumers | RabbitMQ SAC s | msgs/s | speed-up |",
        "|---|---|---|---|",
    ]
    for n in r["consumers"]:
        cell = r["handler_bound"][str(n)]
        speedup = cell["speedup_vs_1"]
        lines.append(f"| {n} | {cell['seconds']:.2f} | {cell['msgs_per_s']:,.0f} | {speedup:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        url, prefix, queues, index, consumers, go, out, handler_ms = sys.argv[2:10]
        worker(url, prefix, int(queues), int(index), int(consumers), go, out, float(handler_ms))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--url", default=DEFAULT_URL)
    ap.add_argument("--keys", type=int, default=10_000)
    ap.add_argument("--per-key", type=int, default=2)
    ap.add_argument("--handler-ms", type=float, default=2.0)
    ap.add_argument("--consumers", default="1,2,4,8")
    ap.add_argument("--queues", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--server-pids", default="", help="the node's processes (N,N,…), for its CPU per cell")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document too (last line)")
    args = ap.parse_args()
    counts = [int(x) for x in args.consumers.split(",")]
    pids = [int(p) for p in args.server_pids.split(",") if p]
    result = measure(args.url, args.keys, args.per_key, args.handler_ms, counts, args.queues, args.repeats, pids)
    print(table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
