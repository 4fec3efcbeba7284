"""kill -9 of a delay group's master holding many pending messages due over the next minute
(issue 24): a meta server, two broker groups and a delay group of a master and a slave, each a
real process; ``--messages`` delay messages due uniformly over ``--spread-s`` seconds from
``--lead-s`` on are sent, a consumer group takes them as they come, and the master is killed
(SIGKILL) once ``--kill-at`` of the spread has passed: whichever of the two is master then (on a
loaded machine the meta server may have promoted the slave already during the sends, a master
silent past the 2 s heartbeat timeout: counted as ``failovers_before_kill``). The meta server
promotes the other; with
``--restart-old`` the old master is started again on its data afterwards and must follow the
new one and hand nothing over. Reports what was lost, early or delivered twice (all must be
0), how late messages came, and how long the promotion took.

    .venv/bin/python -m bench.delay_failover                          # 100,000 over 60 s, old master restarted
    .venv/bin/python -m bench.delay_failover --messages 20000 --no-restart-old

Exit status 1 when a message was lost, early or repeated, or the old master handed over.
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
import urllib.request
from collections import Counter
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from qmq.aio import Consumer, Producer
from qmq.client.connection import Connection
from qmq.common.errors import QmqError
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_role

SUBJECT = "bench.delay.failover"
_OUTSTANDING_MAX = 5_000
_HEARTBEAT = ["--heartbeat-interval-ms", "300"]


def _view(meta_server: str) -> dict[str, Any]:
    with urllib.request.urlopen(meta_server.removesuffix("/meta/address") + "/meta/cluster", timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def _server(meta_server: str, address: str) -> dict[str, Any] | None:
    return next((s for s in _view(meta_server)["servers"] if s["address"] == address), None)


async def _until(what: str, ok: Any, timeout_s: float) -> float:
    """Poll ``ok()`` every 50 ms; seconds it took (AssertionError at the deadline)."""
    began = time.monotonic()
    while not await asyncio.to_thread(ok):
        if time.monotonic() - began > timeout_s:
            raise AssertionError(f"{what}: not so within {timeout_s} s")
        await asyncio.sleep(0.05)
    return time.monotonic() - began


async def _dispatched(address: str) -> int:
    conn = Connection(address, connect_timeout_ms=3000)
    try:
        return int(answer_of(await conn.request(RequestCode.DELAY_STATS, {}))["dispatched_total"])
    finally:
        await conn.close()


def _delay(data_dir: Path, meta_server: str, role: str) -> list[str]:
    return [
        "delay", "--data-dir", str(data_dir), "--meta-server", meta_server, "--group", "d1", "--role", role,
        *_HEARTBEAT, "--slave-timeout-ms", "3000",
    ]  # fmt: skip


async def run(args: argparse.Namespace, tmp: Path) -> dict[str, Any]:
    with ExitStack() as stack:
        meta = stack.enter_context(
            running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0", "--heartbeat-timeout-ms", "2000"])
        )
        url = meta.meta_server
        for group in ("b1", "b2"):  # the subject is routed to both
            stack.enter_context(
                running_role(
                    ["broker", "--data-dir", str(tmp / group), "--meta-server", url, "--group", group, *_HEARTBEAT]
                )
            )
        master: ReadyProcess = stack.enter_context(running_role(_delay(tmp / "d1-m", url, "master")))
        slave: ReadyProcess = stack.enter_context(running_role(_delay(tmp / "d1-s", url, "slave")))

        def replicating() -> bool:
            s = _server(url, slave.ready["address"])
            return s is not None and s["replicated_ms"] > 0

        await _until("the slave replicating", replicating, 30)
        due: dict[str, int] = {}
        received: dict[str, float] = {}
        repeats: Counter[str] = Counter()
        async with (
            Producer(app_code="bench", meta_server=url) as producer,
            Consumer(app_code="bench", meta_server=url, consumer_id="c1") as consumer,
        ):
            pull = consumer.pull_consumer(SUBJECT, "bench", start_from="earliest")
            done = asyncio.Event()
            all_in = asyncio.Event()  # every message sent was received once

            async def consume() -> None:
                while not done.is_set():
                    try:
                        batch = await pull.pull(max_messages=1000, timeout_ms=200)
                    except QmqError:
                        await asyncio.sleep(0.1)  # between masters: ask again shortly
                        continue
                    at = time.time() * 1000
                    for m in batch:
                        if m.message_id in received:
                            repeats[m.message_id] += 1
                        else:
                            received[m.message_id] = at
                    if due and len(received) >= len(due):
                        all_in.set()
                    await batch.ack_all()

            consuming = asyncio.ensure_future(consume())
            start_ms = int(time.time() * 1000) + int(args.lead_s * 1000)
            spread_ms = int(args.spread_s * 1000)
            sent_began = time.monotonic()
            outstanding: set[asyncio.Future[None]] = set()
            send_failed: list[str] = []  # not acknowledged: never counted as lost

            def settled(mid: str, fut: asyncio.Future[None]) -> None:
                outstanding.discard(fut)
                if fut.exception() is not None:
                    send_failed.append(mid)

            for i in range(args.messages):
                m = producer.generate_message(SUBJECT)
                m.body = b"x" * 100
                at = start_ms + i * spread_ms // args.messages
                m.set_deliver_at(at / 1000)
                due[m.message_id] = at
                fut = producer.send_nowait(m)
                outstanding.add(fut)
                fut.add_done_callback(functools.partial(settled, m.message_id))
                if len(outstanding) >= _OUTSTANDING_MAX:
                    await asyncio.wait(outstanding, return_when=asyncio.FIRST_COMPLETED)
            await asyncio.gather(*outstanding, return_exceptions=True)
            send_s = time.monotonic() - sent_began
            print(f"sent {args.messages:,} in {send_s:.1f} s", file=sys.stderr)

            kill_ms = start_ms + int(spread_ms * args.kill_at)
            await asyncio.sleep(max(0.0, (kill_ms - time.time() * 1000) / 1000))
            before_kill = len(received)
            row = next(g for g in _view(url)["groups"] if g["role"] == "delay" and g["group"] == "d1")
            epoch_at_kill = int(row["epoch"])
            # the master now, which need not be the one started as master (module docstring)
            victim, survivor = (master, slave) if row["master"] == master.ready["address"] else (slave, master)
            victim_dir = tmp / ("d1-m" if victim is master else "d1-s")
            os.kill(victim.pid, signal.SIGKILL)
            victim.proc.wait()
            killed_at = time.time() * 1000
            print(f"killed the master (epoch {epoch_at_kill}) with {before_kill:,} received", file=sys.stderr)

            def promoted() -> bool:
                s = _server(url, survivor.ready["address"])
                return s is not None and s["role_in_group"] == "master" and s["epoch"] > epoch_at_kill

            promotion_s = await _until("the slave promoted", promoted, 60)
            old_dispatched = None
            if args.restart_old:
                old = stack.enter_context(running_role(_delay(victim_dir, url, "master")))

                def following() -> bool:
                    s = _server(url, old.ready["address"])
                    return s is not None and s["role_in_group"] == "slave" and s["epoch"] > epoch_at_kill

                await _until("the old master following", following, 60)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(all_in.wait(), args.spread_s + args.lead_s + 120)
            await asyncio.sleep(3)  # anything handed over twice would come by now
            done.set()
            await consuming
            if args.restart_old:
                old_dispatched = await _dispatched(old.ready["address"])
            new_dispatched = await _dispatched(survivor.ready["address"])

    for mid in send_failed:  # a send that failed may still have been stored: then it came
        if mid not in received:
            del due[mid]
    lost = sorted(due.keys() - received.keys(), key=lambda i: due[i])
    late = [received[i] - due[i] for i in received]
    after_kill = [received[i] - due[i] for i in received if due[i] >= killed_at]
    return {
        "messages": args.messages,
        "spread_s": args.spread_s,
        "send_s": round(send_s, 2),
        "send_msgs_per_s": round(args.messages / send_s),
        "send_failed": len(send_failed),
        "send_failed_but_delivered": sum(1 for mid in send_failed if mid in received),
        "failovers_before_kill": epoch_at_kill - 1,
        "received_before_kill": before_kill,
        "promotion_s_after_kill": round(promotion_s, 2),
        "lost": len(lost),
        "lost_due_ms_after_kill": [round(due[i] - killed_at) for i in lost[:20]],
        "lost_ids": lost[:20],  # to look for in the brokers' logs of a run kept with --keep
        "early": sum(1 for x in late if x < 0),
        "delivered_twice": sum(repeats.values()),
        "late_ms_p50": round(statistics.median(late)) if late else None,
        "late_ms_p99": round(statistics.quantiles(late, n=100)[98]) if len(late) > 100 else None,
        "late_ms_max": round(max(late)) if late else None,
        "late_ms_max_due_after_kill": round(max(after_kill)) if after_kill else None,
        "handed_over_by_new_master": new_dispatched,
        "handed_over_by_old_master_restarted": old_dispatched,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--messages", type=int, default=100_000)
    parser.add_argument("--spread-s", type=float, default=60.0, help="messages are due over this many seconds")
    parser.add_argument("--lead-s", type=float, default=15.0, help="the first is due this long after the sends begin")
    parser.add_argument(
        "--kill-at", type=float, default=0.3, help="kill the master once this share of the spread passed"
    )
    parser.add_argument("--restart-old", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--keep", action="store_true", help="keep the data directories (and logs) afterwards")
    parser.add_argument("--dir", type=Path, default=None, help="where the data goes (default: a temporary directory)")
    args = parser.parse_args()
    if args.keep:
        tmp = tempfile.mkdtemp(prefix="qmq-delay-failover-", dir=args.dir)
        print(f"data and logs kept in {tmp}", file=sys.stderr)
        result = asyncio.run(run(args, Path(tmp)))
    else:
        with tempfile.TemporaryDirectory(prefix="qmq-delay-failover-", dir=args.dir) as tmp:
            result = asyncio.run(run(args, Path(tmp)))
    print(json.dumps(result, indent=2))
    bad = (
        result["lost"] or result["early"] or result["delivered_twice"] or result["handed_over_by_old_master_restarted"]
    )
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()
