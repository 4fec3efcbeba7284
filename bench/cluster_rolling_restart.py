"""What a rolling restart costs the clients of a cluster: `qmq cluster up` (2 broker groups of a
master and a slave, a delay group; heartbeats every 300 ms, a group silent 2 s is unavailable,
clients refresh every 300 ms; sends acknowledged once fsynced and on the slave), a steady load of
sends and one consumer group taking them, and `qmq cluster rolling-restart` meanwhile.

Reports the largest gap between two acknowledged sends while the restart ran, the messages in
flight at most (sent, not yet answered), sends acknowledged and failed, acknowledged messages the
consumer group never got, and how long the restart took; and the same (``delay_*``) for a
second load of messages due 1.5 s after their send, which go through the delay group (a master
and a slave: the slave is restarted first, then promoted before its master restarts).

    .venv/bin/python -m bench.cluster_rolling_restart [--senders 4] [--send-every-ms 2] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from qmq.aio import Consumer, Producer
from qmq.testing import write_config
from qmq.testing.load import Load, LoadRecord

SUBJECT = "bench.rolling"
# a line of `qmq cluster rolling-restart` for one process restarted: "  b1-s1    pid 12 -> 34  ..."
_STEP = re.compile(r"^\s+(\S+)\s+pid \d+ -> \d+")
LATER = "bench.rolling.later"
_CONFIG = {
    "meta": {"heartbeat_timeout_ms": 2_000, "client_refresh_ms": 300},
    "broker": {"heartbeat_interval_ms": 300, "slave_timeout_ms": 2_000},
    "delay": {"heartbeat_interval_ms": 300},
}


def _qmq(*args: str, timeout_s: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], capture_output=True, text=True, timeout=timeout_s, check=False
    )


async def _measure(meta_server: str, data_dir: Path, senders: int, send_every_s: float) -> dict[str, Any]:
    async with (
        Producer(app_code="bench", meta_server=meta_server, retry_backoff_ms=20) as producer,
        Consumer(app_code="bench", meta_server=meta_server, consumer_id="bench-1") as consumer,
    ):
        load = Load(
            producer,
            consumer.pull_consumer(SUBJECT, "bench", start_from="earliest"),
            SUBJECT,
            senders=senders,
            send_every_s=send_every_s,
        )
        later = Load(
            producer,
            consumer.pull_consumer(LATER, "bench", start_from="earliest"),
            LATER,
            senders=1,
            send_every_s=0.005,
            delay_ms=1_500,
        )
        load.start()
        later.start()
        await load.until_acked(1_000)
        await later.until_acked(100)
        loop = asyncio.get_running_loop()
        began = loop.time()
        load.record.in_flight_max = 0  # the peak while the restart runs
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "qmq",
            "cluster",
            "rolling-restart",
            "--data-dir",
            str(data_dir),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        steps: list[tuple[str, float]] = []  # each process restarted, and when its step ended
        while line := await proc.stdout.readline():  # one line per process, as each is done
            if m := _STEP.match(line.decode()):
                steps.append((m[1], loop.time()))
        err = await proc.stderr.read() if proc.stderr is not None else b""
        await proc.wait()
        ended = loop.time()
        in_flight_max = load.record.in_flight_max
        if proc.returncode != 0:
            raise SystemExit(f"rolling-restart exited {proc.returncode}: {err.decode()}")
        acked_during = sum(1 for t in load.record.acked.values() if began <= t <= ended)
        await load.stop()
        await later.stop()
    r = load.record
    d = later.record
    return {
        "largest_send_gap_s": round(r.largest_gap_s(began, ended), 3),
        "in_flight_max": in_flight_max,
        "acked_during_restart": acked_during,
        "acked": len(r.acked),
        "failed": len(r.failed),
        "failures": r.failed[:3],
        "lost": len(r.acked.keys() - r.received),
        "restart_s": round(ended - began, 1),
        "processes": len(steps),
        "delay_largest_send_gap_s": round(d.largest_gap_s(began, ended), 3),
        # where the delayed sends waited longest: in the step of which process
        "delay_largest_gap_by_step_s": _gaps_by_step(d, began, steps),
        "delay_acked": len(d.acked),
        "delay_failed": len(d.failed),
        "delay_failures": d.failed[:3],
        "delay_lost": len(d.acked.keys() - d.received),
    }


def _gaps_by_step(record: LoadRecord, began: float, steps: list[tuple[str, float]]) -> dict[str, float]:
    """The longest time without an acknowledged send within each process's step."""
    out, at = {}, began
    for name, ended in steps:
        out[name] = round(record.largest_gap_s(at, ended), 2)
        at = ended
    return out


def run_once(senders: int, send_every_s: float) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="qmq-bench-rolling-") as tmp:
        data_dir = Path(tmp) / "cluster"
        config = write_config(Path(tmp) / "config.toml", _CONFIG)
        args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "1", "--config", str(config)]
        up = _qmq("cluster", "up", "--data-dir", str(data_dir), *args, timeout_s=180)
        if up.returncode != 0:
            raise SystemExit(f"cluster up failed: {up.stderr}")
        meta_server = next(p.split("=", 1)[1] for p in up.stdout.split() if p.startswith("meta_server="))
        try:
            time.sleep(3)  # let both slaves start replicating (a bench, not a test: a fixed settle)
            with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
                return runner.run(_measure(meta_server, data_dir, senders, send_every_s))
        finally:
            _qmq("cluster", "down", "--data-dir", str(data_dir), timeout_s=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--senders", type=int, default=4)
    parser.add_argument("--send-every-ms", type=float, default=2.0, help="each sender's pace")
    parser.add_argument("--runs", type=int, default=1)
    ns = parser.parse_args()
    for i in range(ns.runs):
        figures = run_once(ns.senders, ns.send_every_ms / 1000)
        print(json.dumps({"run": i + 1, "senders": ns.senders, "send_every_ms": ns.send_every_ms, **figures}))


if __name__ == "__main__":
    main()
