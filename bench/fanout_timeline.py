"""W9's live part in one process, with a timeline: where a fan-out's delivery tail comes from.

One producer sends ``--rate`` messages a second (1 KiB, the send time in the first 8 bytes) to a
subject of its own for ``--seconds``; one consumer of ``--groups`` consumer groups of that
subject pulls them all together (``Consumer.pull_many``, ``--max-messages`` a pull and
``--per-group`` of each group) and acks each batch. Both live in this process, against a running
qmq (``--meta-server``, e.g. a ``qmq standalone``'s). It prints the delivery latency (send to
receipt) over the whole run and for each ``--bucket-ms`` of send time, so a stall that comes
back at a rhythm shows where it happens, and the collector's full passes this process made
(count and longest). ``--freeze`` calls ``gc.freeze()`` once the consumer is set up, taking
start-up's objects out of those passes (docs/consuming.md, "A consumer process's latency tail").

    .venv/bin/python -m bench.fanout_timeline --meta-server URL [--groups 70] [--freeze]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import struct
import time
from array import array
from typing import Any

import uvloop

from bench.consumers import by_bucket
from bench.stats import distribution_ms
from qmq.aio import Consumer, Message, Producer

_STAMP = struct.Struct("<q")
_BODY_BYTES = 1024
_IDLE_S = 0.002  # a pull that found nothing: the next after this long (as the bench's adapter)


class GcPasses:
    """The full passes (generation 2) of the collector in this process: how many, the longest."""

    def __init__(self) -> None:
        self.count = 0
        self.longest_ms = 0.0
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
            return
        self.count += 1
        self.longest_ms = max(self.longest_ms, (time.perf_counter() - self._started) * 1000)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    subject = f"timeline{os.getpid()}"
    total = args.rate * args.seconds
    # arrays, which the collector never walks (a list of a million ints it walks on every full pass)
    sent_ns = array("q")
    latency_ns = array("q")
    passes = GcPasses()
    async with (
        Consumer(app_code="bench", meta_server=args.meta_server, consumer_id=f"timeline-{os.getpid()}") as consumer,
        Producer(app_code="bench", meta_server=args.meta_server) as producer,
    ):
        pcs = [consumer.pull_consumer(subject, group=f"g{i}", start_from="earliest") for i in range(args.groups)]
        await consumer.pull_many(pcs, max_messages=args.max_messages, per_subject_max=args.per_group)
        if args.freeze:
            gc.freeze()
        gc.callbacks.append(passes)

        async def produce() -> None:
            start = time.monotonic()
            sent = 0
            pending: list[asyncio.Future[None]] = []
            while sent < total:
                due = min(total, int((time.monotonic() - start) * args.rate) + 1)
                for _ in range(sent, due):
                    message: Message = producer.generate_message(subject)
                    message.body = _STAMP.pack(time.monotonic_ns()) + bytes(_BODY_BYTES - _STAMP.size)
                    pending.append(producer.send_nowait(message))
                sent = max(sent, due)
                pending = [f for f in pending if not f.done()]
                await asyncio.sleep(0.001)
            await asyncio.gather(*pending)

        async def consume() -> None:
            want = total * args.groups
            while len(latency_ns) < want:
                batches = await consumer.pull_many(pcs, max_messages=args.max_messages, per_subject_max=args.per_group)
                now = time.monotonic_ns()
                got = 0
                for batch in batches:
                    for m in batch:
                        stamp = _STAMP.unpack_from(m.body)[0]
                        sent_ns.append(stamp)
                        latency_ns.append(now - stamp)
                        got += 1
                    if len(batch):
                        await batch.ack_all()
                if not got:
                    await asyncio.sleep(_IDLE_S)

        try:
            await asyncio.wait_for(asyncio.gather(produce(), consume()), args.seconds * 5 + 30)
        finally:
            gc.callbacks.remove(passes)
    return {
        "groups": args.groups,
        "rate_per_s": args.rate,
        "freeze": args.freeze,
        "latency_ms": distribution_ms(latency_ns),
        "gc_full_passes": passes.count,
        "gc_longest_full_pass_ms": round(passes.longest_ms, 1),
        "timeline": [
            {"from_s": k * args.bucket_ms / 1000, **dist} for k, dist in by_bucket(sent_ns, latency_ns, args.bucket_ms)
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--meta-server", required=True)
    parser.add_argument("--groups", type=int, default=70)
    parser.add_argument("--rate", type=int, default=1_000, help="messages a second into the subject")
    parser.add_argument("--seconds", type=int, default=20)
    parser.add_argument("--max-messages", type=int, default=7_000, help="a pull's messages in all (W9: 100 a group)")
    parser.add_argument("--per-group", type=int, default=100, help="a pull's messages of one group")
    parser.add_argument("--bucket-ms", type=int, default=250)
    parser.add_argument("--freeze", action="store_true", help="gc.freeze() once the consumer is set up")
    args = parser.parse_args()
    result = uvloop.run(run(args))
    whole = result["latency_ms"]
    print(
        f"{whole['n']:,} deliveries, {args.groups} groups: p50 {whole['p50']} ms, p99 {whole['p99']} ms, "
        f"p99.9 {whole['p999']} ms, max {whole['max']} ms; {result['gc_full_passes']} full GC passes, "
        f"the longest {result['gc_longest_full_pass_ms']} ms"
    )
    for row in result["timeline"]:
        print(
            f"  {row['from_s']:7.2f} s  {row['n']:7,}  p50 {row['p50']:7.1f}  p99 {row['p99']:7.1f}  "
            f"max {row['max']:7.1f} ms"
        )
    print(json.dumps({k: v for k, v in result.items() if k != "timeline"}))


if __name__ == "__main__":
    main()
