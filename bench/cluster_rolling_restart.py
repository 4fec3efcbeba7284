"""What a rolling restart costs the clients of a cluster: `qmq cluster up` (2 broker groups of a
master and a slave, a delay group; heartbeats every 300 ms, a group silent 2 s is unavailable,
clients refresh every 300 ms; sends acknowledged once fsynced and on the slave), a steady load of
sends and one consumer group taking them, and `qmq cluster rolling-restart` meanwhile.

Reports the largest gap between two acknowledged sends while the restart ran, the messages in
flight at most (sent, not yet answered), sends acknowledged and failed, acknowledged messages the
consumer group never got, and how long the restart took.

    .venv/bin/python -m bench.cluster_rolling_restart [--senders 4] [--send-every-ms 2] [--runs 1]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import uvloop

from qmq.aio import Consumer, Producer
from qmq.testing import write_config
from qmq.testing.load import Load

SUBJECT = "bench.rolling"
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
        load.start()
        await load.until_acked(1_000)
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
            "--json",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        out, err = await proc.communicate()
        ended = loop.time()
        in_flight_max = load.record.in_flight_max
        if proc.returncode != 0:
            raise SystemExit(f"rolling-restart exited {proc.returncode}: {err.decode()}")
        acked_during = sum(1 for t in load.record.acked.values() if began <= t <= ended)
        await load.stop()
    r = load.record
    return {
        "largest_send_gap_s": round(r.largest_gap_s(began, ended), 3),
        "in_flight_max": in_flight_max,
        "acked_during_restart": acked_during,
        "acked": len(r.acked),
        "failed": len(r.failed),
        "lost": len(r.acked.keys() - r.received),
        "restart_s": round(ended - began, 1),
        "processes": len(json.loads(out)["restarted"]),
    }


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
