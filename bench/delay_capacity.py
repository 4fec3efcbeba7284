"""Capacity of qmq's delay server, in two runs against one `qmq standalone`:

1. **Backlog**: realtime sends first (the baseline), then ``--messages`` delay messages
   (default 5,000,000, ``--body-bytes`` 100) due uniformly over the next ``--days`` (30), sent
   by the same asyncio producer the same way. Reported: send rates (delayed ÷ realtime), the
   delay server's RSS before and after (and its peak), RSS per pending message, the disk the
   delay server's data takes, and what DELAY_STATS says it holds.
2. **Coming due**: ``--due-rate`` messages a second (default 10,000) coming due for
   ``--due-seconds`` (30), sent beforehand; a consumer in its own process measures lateness
   (receipt − due, wall clock): p50, p99, p99.9, max, and how many came early.

    .venv/bin/python -m bench.delay_capacity                       # both runs, full size
    .venv/bin/python -m bench.delay_capacity --messages 200000 --due-seconds 10   # a quick look

Prints a markdown summary and one JSON line (``--json FILE`` writes it to a file too).
Stops the standalone with SIGTERM at the end. Data goes to a temp dir (``--data-dir`` to keep it).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import struct
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.procfs import rss_kib

_APP = "bench-delay"
_WINDOW = 20_000  # sends in flight from the producer
_STAMP = struct.Struct("<q")  # due time (epoch ms) at the front of each body
_CONSUMER_START_S = 15.0
# how long after the last due time the consumer waits for stragglers
_CONSUMER_AFTER_S = 30.0


def _body(due_ms: int, body_bytes: int, filler: bytes) -> bytes:
    return _STAMP.pack(due_ms) + filler[: max(0, body_bytes - _STAMP.size)]


async def _send_all(producer: Any, subject: str, n: int, due_of: Any, body_bytes: int) -> float:
    """Send ``n`` messages (``due_of(i)`` epoch seconds or None for realtime); returns msg/s."""
    from qmq import BufferFullError

    filler = os.urandom(max(body_bytes, 8))
    pending: set[asyncio.Future[None]] = set()
    failures: list[BaseException] = []

    def done(f: asyncio.Future[None]) -> None:
        pending.discard(f)
        if not f.cancelled() and f.exception() is not None:
            failures.append(f.exception())  # type: ignore[arg-type]

    start = time.perf_counter()
    for i in range(n):
        m = producer.generate_message(subject)
        due = due_of(i)
        if due is not None:
            m.set_deliver_at(due)
        m.body = _body(m.deliver_at_ms, body_bytes, filler)
        while True:
            if len(pending) >= _WINDOW:
                await asyncio.wait(list(pending)[:1])
            try:
                f = producer.send_nowait(m)
                break
            except BufferFullError:
                await asyncio.wait(list(pending)[:1])
        pending.add(f)
        f.add_done_callback(done)
        if failures:
            raise RuntimeError(f"send failed: {failures[0]}")
    while pending:
        await asyncio.wait(list(pending))
    if failures:
        raise RuntimeError(f"send failed: {failures[0]}")
    return n / (time.perf_counter() - start)


class _RssSampler(threading.Thread):
    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.peak_kib = 0
        self._done = threading.Event()

    def run(self) -> None:
        while not self._done.wait(0.2):  # sampling period
            self.peak_kib = max(self.peak_kib, rss_kib(self.pid) or 0)

    def stop(self) -> int:
        self._done.set()
        self.join(5)
        return self.peak_kib


def _du_bytes(path: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.stat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


async def _delay_stats(meta_server: str) -> dict[str, Any]:
    from qmq.cli.delay_commands import ask_every_delay_group

    answers = await ask_every_delay_group(meta_server, {"buckets_max": 0})
    (answer,) = answers.values()
    if isinstance(answer, BaseException):
        raise answer
    return answer


async def backlog_run(meta_server: str, delay_pid: int, data_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    from qmq.aio import Producer

    out: dict[str, Any] = {}
    async with Producer(app_code=_APP, meta_server=meta_server) as producer:
        await _send_all(producer, "cap.warmup", 2_000, lambda i: None, args.body_bytes)
        baseline_n = min(args.messages, args.baseline_messages)
        out["realtime_msgs_per_s"] = round(
            await _send_all(producer, "cap.realtime", baseline_n, lambda i: None, args.body_bytes)
        )
        rss_before = rss_kib(delay_pid) or 0
        sampler = _RssSampler(delay_pid)
        sampler.start()
        now = time.time()
        span_s = args.days * 86_400
        rng = random.Random(7)
        dues = lambda i: now + 60 + rng.random() * span_s  # noqa: E731
        first = min(args.messages, baseline_n)
        out["delayed_msgs_per_s_first"] = round(await _send_all(producer, "cap.delayed", first, dues, args.body_bytes))
        t0 = time.perf_counter()
        rest = args.messages - first
        if rest:
            await _send_all(producer, "cap.delayed", rest, dues, args.body_bytes)
        whole_s = time.perf_counter() - t0
        out["delayed_msgs_per_s_all"] = round(args.messages / (whole_s + first / out["delayed_msgs_per_s_first"]))
    await asyncio.sleep(args.settle_s)  # let a checkpoint write the schedule buffers out
    peak = sampler.stop()
    rss_after = rss_kib(delay_pid) or 0
    stats = await _delay_stats(meta_server)
    pending = int(stats["pending"])
    out.update(
        {
            "messages": args.messages,
            "days": args.days,
            "body_bytes": args.body_bytes,
            "send_ratio_delayed_to_realtime": round(out["delayed_msgs_per_s_first"] / out["realtime_msgs_per_s"], 3),
            "delay_rss_before_mib": round(rss_before / 1024, 1),
            "delay_rss_after_mib": round(rss_after / 1024, 1),
            "delay_rss_peak_mib": round(peak / 1024, 1),
            "pending": pending,
            "rss_bytes_per_pending": round(rss_after * 1024 / pending, 1) if pending else None,
            "rss_growth_bytes_per_pending": round((rss_after - rss_before) * 1024 / pending, 1) if pending else None,
            "buckets": stats["buckets_total"],
            "timer_rows": stats["timer_rows"],
            "delay_disk_mib": round(_du_bytes(data_dir / "delay") / 2**20, 1),
            "delay_schedule_disk_mib": round(_du_bytes(data_dir / "delay" / "schedule") / 2**20, 1),
            "delay_wal_disk_mib": round(_du_bytes(data_dir / "delay" / "wal") / 2**20, 1),
        }
    )
    return out


def _consume(meta_server: str, subject: str, n: int, give_up_epoch_s: float, ready: Any, result: Any) -> None:
    """Consumer process of the coming-due run: lateness of every message, in ms."""
    import uvloop

    async def run() -> dict[str, Any]:
        from qmq.aio import Consumer

        lateness: list[float] = []
        seen: set[str] = set()
        duplicates = 0
        async with Consumer(app_code=_APP, meta_server=meta_server, consumer_id=f"cap-{os.getpid()}") as consumer:
            pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
            await pull.pull(max_messages=1, timeout_ms=0)
            ready.set()
            while len(lateness) < n and time.time() < give_up_epoch_s:
                batch = await pull.pull(max_messages=1000, timeout_ms=1000)
                now_ms = time.time() * 1000
                for m in batch:
                    if m.message_id in seen:
                        duplicates += 1
                        continue
                    seen.add(m.message_id)
                    (due_ms,) = _STAMP.unpack_from(m.body)
                    lateness.append(now_ms - due_ms)
                await batch.ack_all()
        lateness.sort()

        def q(p: float) -> float | None:
            return round(lateness[min(len(lateness) - 1, int(p * len(lateness)))], 2) if lateness else None

        return {
            "received": len(lateness),
            "duplicates": duplicates,
            "early": sum(1 for x in lateness if x < 0),
            "lateness_ms": {"p50": q(0.5), "p99": q(0.99), "p999": q(0.999), "max": q(1.0), "min": q(0.0)},
        }

    result.put(uvloop.run(run()))


async def coming_due_run(meta_server: str, args: argparse.Namespace) -> dict[str, Any]:
    from qmq.aio import Producer

    n = int(args.due_rate * args.due_seconds)
    subject = f"cap.due.{os.getpid()}"
    # due times start once the consumer runs and every message is surely sent: the sends must
    # not overlap the run
    lead_s = _CONSUMER_START_S + 5.0 + n / args.send_rate_estimate
    first_due = time.time() + lead_s
    give_up = first_due + args.due_seconds + _CONSUMER_AFTER_S
    ctx = multiprocessing.get_context("spawn")
    ready, result = ctx.Event(), ctx.Queue()
    consumer = ctx.Process(target=_consume, args=(meta_server, subject, n, give_up, ready, result), daemon=True)
    consumer.start()
    if not ready.wait(_CONSUMER_START_S):
        raise RuntimeError(f"the consumer process did not start within {_CONSUMER_START_S} s")
    async with Producer(app_code=_APP, meta_server=meta_server) as producer:
        send_rate = await _send_all(
            producer, subject, n, lambda i: first_due + i / args.due_rate, max(args.body_bytes, _STAMP.size)
        )
    left_s = first_due - time.time()
    got = await asyncio.get_running_loop().run_in_executor(None, result.get, True, lead_s + args.due_seconds + 120)
    consumer.join(10)
    got.update(
        {
            "messages": n,
            "due_rate_per_s": args.due_rate,
            "due_seconds": args.due_seconds,
            "send_msgs_per_s": round(send_rate),
            "lead_left_when_sent_s": round(left_s, 2),
        }
    )
    return got


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.delay_capacity", description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=5_000_000, help="delay messages of the backlog run")
    parser.add_argument("--days", type=float, default=30.0, help="the backlog is due uniformly over this many days")
    parser.add_argument("--body-bytes", type=int, default=100)
    parser.add_argument("--baseline-messages", type=int, default=500_000, help="realtime sends of the baseline")
    parser.add_argument("--due-rate", type=float, default=10_000.0, help="messages a second coming due")
    parser.add_argument("--due-seconds", type=float, default=30.0)
    parser.add_argument("--send-rate-estimate", type=float, default=15_000.0, help="msg/s, to set the lead time")
    parser.add_argument("--flush", choices=("sync", "periodic"), default="sync", help="broker and delay server")
    parser.add_argument("--settle-s", type=float, default=12.0, help="wait after the backlog before measuring")
    parser.add_argument("--skip-backlog", action="store_true")
    parser.add_argument("--skip-coming-due", action="store_true")
    parser.add_argument("--data-dir", type=Path, default=None, help="keep the data here (default: a temp dir)")
    parser.add_argument("--json", type=Path, default=None, help="also write the JSON result to this file")
    parser.add_argument(
        "--delay-option", action="append", default=[], metavar="KEY=VALUE", help="a [delay] setting (repeatable)"
    )
    args = parser.parse_args()

    import uvloop

    from qmq.testing import running_standalone

    root = args.data_dir or Path(tempfile.mkdtemp(prefix="qmq-delay-capacity-"))
    data_dir = root / "qmq-data"
    delay: dict[str, Any] = {"flush": args.flush}
    for item in args.delay_option:
        key, _, value = item.partition("=")
        delay[key] = int(value) if value.isdigit() else value
    config = {"broker": {"flush": args.flush}, "delay": delay}
    result: dict[str, Any] = {
        "flush": args.flush,
        "delay_config": delay,
        "machine_cpus": os.cpu_count(),
        "loadavg": os.getloadavg(),
    }
    try:
        with running_standalone(data_dir, config) as standalone:
            meta = standalone.meta_server
            delay_pid = standalone.pid_of("delay")
            if not args.skip_backlog:
                print(f"backlog run: {args.messages:,} messages over {args.days:g} days …", file=sys.stderr, flush=True)
                result["backlog"] = uvloop.run(backlog_run(meta, delay_pid, data_dir, args))
            if not args.skip_coming_due:
                print(f"coming-due run: {args.due_rate:,.0f} msg/s for {args.due_seconds:g} s …", file=sys.stderr)
                result["coming_due"] = uvloop.run(coming_due_run(meta, args))
    finally:
        if args.data_dir is None:
            shutil.rmtree(root, ignore_errors=True)
    _print_summary(result)
    line = json.dumps(result, sort_keys=True)
    print(line)
    if args.json is not None:
        args.json.write_text(line + "\n")
    return 0


def _print_summary(r: dict[str, Any]) -> None:
    print(f"\n## qmq delay server capacity (flush = {r['flush']}, load average at start {r['loadavg']})\n")
    b = r.get("backlog")
    if b:
        print("| backlog | value |\n|---|---|")
        for key in (
            "messages", "days", "body_bytes", "realtime_msgs_per_s", "delayed_msgs_per_s_first",
            "delayed_msgs_per_s_all",
            "send_ratio_delayed_to_realtime", "pending", "buckets", "timer_rows", "delay_rss_before_mib",
            "delay_rss_after_mib", "delay_rss_peak_mib", "rss_bytes_per_pending", "rss_growth_bytes_per_pending",
            "delay_disk_mib", "delay_schedule_disk_mib", "delay_wal_disk_mib",
        ):  # fmt: skip
            print(f"| {key} | {b.get(key)} |")
    c = r.get("coming_due")
    if c:
        lat = c["lateness_ms"]
        print("\n| coming due | value |\n|---|---|")
        print(f"| rate × seconds | {c['due_rate_per_s']:,.0f}/s × {c['due_seconds']:g} s = {c['messages']:,} |")
        print(f"| received / duplicates / early | {c['received']:,} / {c['duplicates']} / {c['early']} |")
        print(f"| lateness p50 / p99 / p99.9 / max ms | {lat['p50']} / {lat['p99']} / {lat['p999']} / {lat['max']} |")
        print(f"| sends beforehand | {c['send_msgs_per_s']:,} msg/s, {c['lead_left_when_sent_s']} s to spare |")
    print()


if __name__ == "__main__":
    sys.exit(main())
