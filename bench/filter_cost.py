"""The filter cell: what messages a group's server-side filter passes over cost its consumer
(issue 23: "filtered-out messages cost the consumer nothing").

One fresh `qmq standalone`; a subject of `--messages` JSON messages of about 1 KiB, one in
`--match-every` (10) carrying `"match": true`. Two consumer groups drain it, each by one pull
consumer in this process (pulls of 500, `ack_all`, acks flushed at the end):

- filtered: the group's filter `body.match` (`qmq group filter`, set before the send): the
  broker passes over the other nine in ten, which count as consumed for it;
- unfiltered: every message, as a consumer that had to filter for itself would get them.

For each drain the consumer's CPU (this process's user + system time, `time.process_time`) and
the bytes it read (`rchar` of /proc/self/io: socket reads, nothing else is read meanwhile), and
the broker's CPU (/proc), are taken around the drain alone; the figures are per message the
consumer receives and per matched message (the ones it wants). `--rounds` rounds (3), each on
subjects of its own, which group drains first alternating; the medians are reported.

    .venv/bin/python -m bench.filter_cost [--messages 100000] [--match-every 10] [--rounds 3] [--json]

`python -m bench run` runs it as its W14 cell ("filtered") against the qmq server of the run
(``--meta-server``, ``--broker-pid``, ``--subject-prefix``, ``--json``: it reads the last line).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

import uvloop

from bench.procfs import cpu_seconds
from qmq.aio import Consumer, Producer
from qmq.common.config import meta_base_url
from qmq.testing import running_standalone

PAD = "x" * 1000
PULL = 500
_LIMIT_S = 120.0


def _read_bytes() -> int:
    with open("/proc/self/io") as f:
        for line in f:
            if line.startswith("rchar:"):
                return int(line.split()[1])
    return 0


def _set_filter(meta: str, subject: str, group: str, expr: str) -> None:
    body = json.dumps({"subject": subject, "group": group, "expr": expr}).encode()
    request = urllib.request.Request(
        f"{meta_base_url(meta)}/meta/controls/filter", data=body, headers={"Content-Type": "application/json"}
    )
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    with opener.open(request, timeout=30) as resp:
        assert resp.status == 200


async def _send(meta: str, subject: str, n: int, match_every: int) -> int:
    matched = 0
    async with Producer(app_code="bench", meta_server=meta) as producer:
        futures = []
        for i in range(n):
            m = producer.generate_message(subject)
            match = i % match_every == 0
            matched += match
            m.body = json.dumps({"n": i, "match": match, "pad": PAD})
            futures.append(producer.send_nowait(m))
            if len(futures) >= 2000:
                await asyncio.gather(*futures)
                futures = []
        await asyncio.gather(*futures)
    return matched


async def _drain(meta: str, subject: str, group: str, want: int, broker_pid: int) -> dict[str, float]:
    async with Consumer(app_code="bench", meta_server=meta) as consumer:
        pc = consumer.pull_consumer(subject, group, "earliest")
        got = matched = 0
        cpu0, read0, broker0, t0 = time.process_time(), _read_bytes(), cpu_seconds(broker_pid) or 0.0, time.monotonic()
        while got < want and time.monotonic() < t0 + _LIMIT_S:
            batch = await pc.pull(PULL, 1000)
            for m in batch:
                matched += b'"match": true' in m.body  # what a consumer without a filter would check itself
            batch.ack_all()
            got += len(batch)
        await consumer.flush_acks()
        cpu, read = time.process_time() - cpu0, _read_bytes() - read0
        broker, elapsed = (cpu_seconds(broker_pid) or 0.0) - broker0, time.monotonic() - t0
    assert got >= want, f"group {group} got {got} of {want}"
    return {
        "received": got,
        "matched": matched,
        "seconds": elapsed,
        "consumer_cpu_s": cpu,
        "bytes_read": read,
        "broker_cpu_s": broker,
        "consumer_cpu_us_per_received": cpu * 1e6 / got,
        "consumer_cpu_us_per_matched": cpu * 1e6 / matched,
        "bytes_per_received": read / got,
        "bytes_per_matched": read / matched,
        "broker_cpu_us_per_stored": broker * 1e6 / 1,  # divided by the subject's messages below
    }


async def measure(meta: str, broker_pid: int, messages: int, match_every: int, rounds: int,
                  prefix: str = "bench.filter") -> dict[str, Any]:
    """The rounds against a running server (its meta server, its broker's pid), on subjects
    named ``prefix`` + the round."""
    runs: list[dict[str, dict[str, float]]] = []
    for r in range(rounds):
        subject = f"{prefix}{r}"
        _set_filter(meta, subject, "filtered", "body.match")
        await asyncio.sleep(1.0)  # a filter holds on the brokers within a second
        matched = await _send(meta, subject, messages, match_every)
        row: dict[str, dict[str, float]] = {}
        order = [("filtered", matched), ("unfiltered", messages)]
        for group, want in order if r % 2 == 0 else order[::-1]:
            row[group] = await _drain(meta, subject, group, want, broker_pid)
            row[group]["broker_cpu_us_per_stored"] = row[group]["broker_cpu_s"] * 1e6 / messages
        runs.append(row)
    out: dict[str, Any] = {"messages": messages, "match_every": match_every, "rounds": rounds, "pull": PULL}
    for group in ("filtered", "unfiltered"):
        out[group] = {key: statistics.median(run[group][key] for run in runs) for key in runs[0][group]}
    out["runs"] = runs
    return out


async def run(messages: int, match_every: int, rounds: int) -> dict[str, Any]:
    """The cell against a fresh `qmq standalone` of its own (flush = "sync")."""
    with tempfile.TemporaryDirectory() as tmp, running_standalone(Path(tmp) / "qmq-data") as proc:
        return await measure(proc.meta_server, int(proc.ready["broker_pid"]), messages, match_every, rounds)


def table(r: dict[str, Any]) -> str:
    f, u = r["filtered"], r["unfiltered"]
    return "\n".join(
        [
            f"filter cell: {r['messages']:,} messages of ~1 KiB, 1 in {r['match_every']} matching, pulls of "
            f"{r['pull']}, one pull consumer per group, medians of {r['rounds']} rounds",
            "",
            "| group | received | consumer CPU s | CPU µs / received | CPU µs / matched | bytes read / matched "
            "| broker CPU µs / stored msg |",
            "|---|---|---|---|---|---|---|",
            f"| filtered (`body.match` on the broker) | {f['received']:,.0f} | {f['consumer_cpu_s']:.2f} | "
            f"{f['consumer_cpu_us_per_received']:.1f} | {f['consumer_cpu_us_per_matched']:.1f} | "
            f"{f['bytes_per_matched']:,.0f} | {f['broker_cpu_us_per_stored']:.1f} |",
            f"| unfiltered (every message) | {u['received']:,.0f} | {u['consumer_cpu_s']:.2f} | "
            f"{u['consumer_cpu_us_per_received']:.1f} | {u['consumer_cpu_us_per_matched']:.1f} | "
            f"{u['bytes_per_matched']:,.0f} | {u['broker_cpu_us_per_stored']:.1f} |",
            f"| filtered ÷ unfiltered, per matched | | | | "
            f"{f['consumer_cpu_us_per_matched'] / u['consumer_cpu_us_per_matched']:.2f} | "
            f"{f['bytes_per_matched'] / u['bytes_per_matched']:.2f} | |",
        ]
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--match-every", type=int, default=10, help="one message in this many matches the filter")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON document too")
    parser.add_argument("--meta-server", help="measure this running server (with --broker-pid)")
    parser.add_argument("--broker-pid", type=int, help="the running server's broker process")
    parser.add_argument("--subject-prefix", default="bench.filter")
    args = parser.parse_args()
    if args.meta_server:
        if not args.broker_pid:
            parser.error("--meta-server needs --broker-pid N")
        result = uvloop.run(measure(args.meta_server, args.broker_pid, args.messages, args.match_every, args.rounds,
                                    args.subject_prefix))
    else:
        result = uvloop.run(run(args.messages, args.match_every, args.rounds))
    print(table(result))
    if args.json:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
