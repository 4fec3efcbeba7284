"""Ordered consumption (issue 20): how it scales with consumers, and what ordering costs.

Two parts, on a fresh `qmq standalone` (flush = sync) or, with ``--meta-server``, a running one:

1. handler-bound: one subject filled with ``--keys`` order keys × ``--per-key`` messages, then
   drained by 1, 2, 4 and 8 consumer processes of a new ordered group each (a listener with
   ``ordered=True``, ``--concurrency`` handlers at once, each ``--handler-ms`` long). The clock
   starts when every consumer of the cell is connected and told to go, and stops when every
   message was handled. Speed-up is against 1 consumer.
2. CPU-bound: one consumer in this process drains ``--drain-keys`` × ``--drain-per-key`` with
   an empty handler, once with an ordered listener and once with a plain one; the drop is the
   cost of ordering (dispatch by slot on the broker, per-key queues in the SDK).

Each cell also reports the server's CPU (utime + stime of its processes, from /proc) per 100k
messages handled: the standalone's own processes, or those ``--server-pids`` names.

    .venv/bin/python -m bench.ordered [--keys 10000] [--per-key 2] [--handler-ms 2] [--concurrency 1]
        [--consumers 1,2,4,8] [--repeats 1] [--rabbitmq amqp://guest:guest@127.0.0.1:5672/%2F] [--json]

``--repeats N`` runs each cell N times and shows the median (the machine is shared: one slow or
one lucky run must not move a figure).

With ``--rabbitmq URL`` the handler-bound cells also run on that RabbitMQ, as single-active-
consumer queues, one per slot group (``bench.ordered_rabbitmq``: how, and what it needs that qmq
does not: a queue count fixed ahead, its queues assigned to consumers by hand).

`python -m bench run` runs it as its W12 cell ("ordered") against the qmq server of the run
(``--meta-server URL --server-pids N,N --subject-prefix P --json``: the last line of its output
is the figures as one JSON document).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.procfs import cpu_seconds
from qmq.aio import Consumer, Producer, ReceivedMessage
from qmq.testing import running_standalone
from qmq.testing.processes import start_ready

_CELL_LIMIT_S = 600.0


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
    meta_server: str, subject: str, group: str, go: str, out: str, handler_ms: float, concurrency: int, ordered: bool
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
            subject, group, handle, start_from="earliest", ordered=ordered, concurrency=concurrency, prefetch=512
        )
        while not stop.is_set():
            _write_count(out, count)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
        _write_count(out, count)


def wait_handled(outs: list[Path], total: int, consumers: int) -> float:
    """Seconds from now until the consumers' count files add up to ``total`` (``go`` just made)."""
    t0 = time.perf_counter()
    while True:
        done = sum(int(o.read_text() or 0) for o in outs if o.exists())
        if done >= total:
            return time.perf_counter() - t0
        if time.perf_counter() - t0 > _CELL_LIMIT_S:
            raise RuntimeError(f"{consumers} consumers handled {done} of {total} in {_CELL_LIMIT_S} s")
        time.sleep(0.02)  # polling the workers' counts


def run_cell(
    meta_server: str, subject: str, consumers: int, total: int, args: argparse.Namespace, tmp: Path, ordered: bool
) -> float:
    """Seconds for ``consumers`` processes of a new (ordered) group to handle ``total`` messages."""
    group = f"g{consumers}-{uuid.uuid4().hex[:6]}"
    go = tmp / f"{group}.go"
    outs = [tmp / f"{group}-c{i}.count" for i in range(consumers)]
    argv = [sys.executable, "-m", "bench.ordered", "--worker", meta_server, subject, group, str(go)]
    mode = "ordered" if ordered else "unordered"
    procs = [start_ready([*argv, str(out), str(args.handler_ms), str(args.concurrency), mode]) for out in outs]
    try:
        go.touch()
        return wait_handled(outs, total, consumers)
    finally:
        for p in procs:
            p.stop()


async def drain(meta_server: str, subject: str, total: int, ordered: bool) -> float:
    """Seconds for one consumer to drain ``subject`` with an empty handler."""
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
        return time.perf_counter() - t0


def drain_s(meta_server: str, subject: str, total: int, ordered: bool) -> float:
    return asyncio.run(drain(meta_server, subject, total, ordered))


def server_cpu_s(pids: list[int]) -> float:
    return sum(cpu_seconds(pid) or 0.0 for pid in pids)


def timed_runs(pids: list[int], repeats: int, one: Callable[[], float]) -> list[tuple[float, float]]:
    """``repeats`` runs of a cell: (its seconds, the server's CPU seconds around it) each."""
    runs = []
    for _ in range(repeats):
        cpu0 = server_cpu_s(pids)
        seconds = one()
        runs.append((seconds, server_cpu_s(pids) - cpu0))
    return runs


def figures(runs: list[tuple[float, float]], total: int, pids: list[int]) -> dict[str, Any]:
    """A cell's medians: seconds, msg/s and (``pids`` known) the server's CPU per 100k messages."""
    seconds = statistics.median(s for s, _ in runs)
    out: dict[str, Any] = {"seconds": round(seconds, 3), "msgs_per_s": round(total / seconds, 1)}
    if pids:
        out["server_cpu_s_per_100k"] = round(statistics.median(c for _, c in runs) * 100_000 / total, 3)
    if len(runs) > 1:
        out["runs_s"] = [round(s, 3) for s, _ in runs]
    return out


def scaled(cells: dict[str, Any], count: int, cell: dict[str, Any]) -> None:
    """Add ``cell`` of ``count`` consumers to ``cells`` with its speed-up against the first."""
    base = next(iter(cells.values()), cell)["seconds"]
    cells[str(count)] = {**cell, "speedup_vs_1": round(base / cell["seconds"], 3)}


def measure(meta_server: str, args: argparse.Namespace, tmp: Path, pids: list[int]) -> dict[str, Any]:
    """Both parts against the server at ``meta_server``, on subjects named after ``--subject-prefix``."""
    counts = [int(x) for x in args.consumers.split(",")]
    subject, total = f"{args.subject_prefix}.ordered", args.keys * args.per_key
    result: dict[str, Any] = {
        "keys": args.keys, "per_key": args.per_key, "messages": total, "handler_ms": args.handler_ms,
        "concurrency": args.concurrency, "consumers": counts, "repeats": args.repeats,
        "fill_msgs_per_s": round(asyncio.run(fill(meta_server, subject, args.keys, args.per_key)), 1),
    }  # fmt: skip
    bound: dict[str, dict[str, Any]] = {"ordered": {}, "unordered": {}}
    for n in counts:
        for ordered, cells in ((True, bound["ordered"]), (False, bound["unordered"])):
            cell = functools.partial(run_cell, meta_server, subject, n, total, args, tmp, ordered)
            runs = timed_runs(pids, args.repeats, cell)
            scaled(cells, n, figures(runs, total, pids))
            print(f"{n} {'ordered' if ordered else 'unordered'}: {cells[str(n)]}", file=sys.stderr, flush=True)
    result["handler_bound"] = bound
    drain_subject, drain_total = f"{args.subject_prefix}.drain", args.drain_keys * args.drain_per_key
    asyncio.run(fill(meta_server, drain_subject, args.drain_keys, args.drain_per_key))
    cpu_bound: dict[str, Any] = {"keys": args.drain_keys, "per_key": args.drain_per_key, "messages": drain_total}
    for ordered in (False, True):
        one = functools.partial(drain_s, meta_server, drain_subject, drain_total, ordered)
        runs = timed_runs(pids, args.repeats, one)
        cpu_bound["ordered" if ordered else "unordered"] = figures(runs, drain_total, pids)
    ratio = cpu_bound["ordered"]["msgs_per_s"] / cpu_bound["unordered"]["msgs_per_s"]
    cpu_bound["ordered_to_unordered"] = round(ratio, 3)
    result["cpu_bound"] = cpu_bound
    return result


def table(r: dict[str, Any]) -> str:
    bound, drained = r["handler_bound"], r["cpu_bound"]
    lines = [
        f"fill: {r['messages']} ordered messages ({r['keys']} keys) sent at {r['fill_msgs_per_s']:,.0f} msgs/s",
        "",
        f"handler-bound: {r['handler_ms']} ms a message, {r['concurrency']} handler(s) at once a consumer"
        + (f", medians of {r['repeats']} runs" if r["repeats"] > 1 else ""),
        "(unordered: the same cell with a plain listener, the machine's own ceiling for this load)",
        "| consumers | ordered s | msgs/s | speed-up | unordered s | msgs/s | speed-up |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in r["consumers"]:
        row = [str(n)]
        for cell in (bound["ordered"][str(n)], bound["unordered"][str(n)]):
            row += [f"{cell['seconds']:.2f}", f"{cell['msgs_per_s']:,.0f}", f"{cell['speedup_vs_1']:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    lines += [
        "",
        f"CPU-bound drain, one consumer, empty handler, {drained['messages']} messages ({drained['keys']} keys)",
        "| listener | msgs/s |",
        "|---|---|",
        *(f"| {name} | {drained[name]['msgs_per_s']:,.0f} |" for name in ("unordered", "ordered")),
    ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        meta_server, subject, group, go, out, handler_ms, concurrency, mode = sys.argv[2:10]
        asyncio.run(
            worker(meta_server, subject, group, go, out, float(handler_ms), int(concurrency), mode == "ordered")
        )
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
    ap.add_argument("--meta-server", help="measure this running qmq server instead of a fresh standalone")
    ap.add_argument("--server-pids", default="", help="its processes (N,N,…), for the server's CPU per cell")
    ap.add_argument("--subject-prefix", default="bench", help="the cell's subjects are PREFIX.ordered, PREFIX.drain")
    ap.add_argument("--json", action="store_true", help="print the figures as one JSON document too (last line)")
    args = ap.parse_args()
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}", file=sys.stderr)
    with tempfile.TemporaryDirectory() as d:
        if args.meta_server:
            pids = [int(p) for p in args.server_pids.split(",") if p]
            result = measure(args.meta_server, args, Path(d), pids)
        else:
            with running_standalone(Path(d) / "qmq") as sa:
                pids = [sa.pid, *(int(v) for k, v in sa.ready.items() if k.endswith("_pid"))]
                result = {**measure(sa.meta_server, args, Path(d), pids), "flush": "sync"}
    print(table(result))
    if args.rabbitmq:
        from bench.ordered_rabbitmq import measure as measure_rabbitmq  # pika: only when asked for
        from bench.ordered_rabbitmq import table as rabbitmq_table

        counts = [int(x) for x in args.consumers.split(",")]
        result["rabbitmq"] = measure_rabbitmq(
            args.rabbitmq, args.keys, args.per_key, args.handler_ms, counts, args.rabbitmq_queues, args.repeats
        )
        print(rabbitmq_table(result["rabbitmq"]))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
