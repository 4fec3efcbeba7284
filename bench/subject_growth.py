"""What a new subject costs, by role: W10's growth on a smaller count, with the figures a
profile needs beside it.

Starts ``qmq standalone`` (bench/servers/qmq.py, flush = sync unless ``--flush``), then makes
``--subjects`` subjects ``--chunk`` at a time, sending each its first message as W10 does
(bench/worker.py ``grow``: one message a batch, ``window_messages`` unacknowledged), and prints
as JSON: new subjects/s, server CPU ms per new subject by role (broker, meta server), RSS bytes
per idle subject by role (2 s after the last send), then the time the standalone takes to stop
and to start again on the data it holds (until its ``qmq ready`` line).

``--pause`` waits for Enter before growing (attach a profiler to the pids it printed).

    .venv/bin/python -m bench.subject_growth [--subjects 5000] [--chunk 1000] [--flush sync]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
import tempfile
import time
from typing import Any

from bench.adapters.qmq import QmqAdapter
from bench.monitor import total_rss_kib
from bench.procfs import cpu_seconds
from bench.producers import produce_bulk
from bench.servers.qmq import QmqServer
from bench.settings import Settings
from bench.worker import many_subject_names
from bench.workloads_many import SETTLE_S, per_subject_bytes

FAMILY = "grow"
LIMIT_S = 900.0


def _by_role(server: QmqServer) -> dict[str, list[int]]:
    roles = server.role_pids()
    return {role: roles[role] for role in ("broker", "meta") if role in roles}


def _cpu_by_role(roles: dict[str, list[int]]) -> dict[str, float]:
    return {role: sum(cpu_seconds(pid) or 0.0 for pid in pids) for role, pids in roles.items()}


async def _grow(endpoint: dict[str, Any], settings: Settings, names: list[str], chunk: int) -> list[float]:
    """Seconds each chunk took to make and send its subjects' first message."""
    adapter = QmqAdapter(endpoint, settings)
    await adapter.connect()
    try:
        await adapter.prepare_producer()
        deadline = time.monotonic() + LIMIT_S
        took = []
        for at in range(0, len(names), chunk):
            part = names[at : at + chunk]
            t0 = time.perf_counter()
            await produce_bulk(adapter, part, len(part), 1, settings.window_messages, deadline, seq_base=at)
            took.append(round(time.perf_counter() - t0, 3))
        return took
    finally:
        await adapter.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.subject_growth", description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=5_000)
    parser.add_argument("--chunk", type=int, default=1_000)
    parser.add_argument("--flush", choices=("sync", "periodic"), default="sync")
    parser.add_argument("--pause", action="store_true", help="wait for Enter before growing")
    parser.add_argument("--no-restart", action="store_true", help="leave out the restart")
    parser.add_argument("--keep", metavar="DIR", help="run in DIR and keep it (the data and server.log)")
    args = parser.parse_args(argv)
    settings = Settings.full()
    names = many_subject_names(FAMILY, args.subjects)
    out: dict[str, Any] = {"subjects": args.subjects, "chunk": args.chunk, "flush": args.flush}
    with contextlib.ExitStack() as stack:
        root = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="qmq-subject-growth-"))
        server = QmqServer(root, args.flush, settings)
        endpoint = server.start()
        try:
            roles = _by_role(server)
            print(f"pids: {json.dumps(roles)}", file=sys.stderr, flush=True)
            if args.pause:
                input("press Enter to grow ")
            time.sleep(SETTLE_S)
            rss_before = {role: total_rss_kib(pids) for role, pids in roles.items()}
            cpu_before = _cpu_by_role(roles)
            t0 = time.perf_counter()
            chunks = asyncio.run(_grow(endpoint, settings, names, args.chunk))
            seconds = time.perf_counter() - t0
            cpu_after = _cpu_by_role(roles)
            time.sleep(SETTLE_S)
            rss_idle = {role: total_rss_kib(pids) for role, pids in roles.items()}
            out.update(
                new_subjects_per_s=round(args.subjects / seconds, 1),
                chunk_s=chunks,
                cpu_ms_per_new_subject={
                    role: round((cpu_after[role] - cpu_before[role]) * 1000 / args.subjects, 3) for role in roles
                },
                rss_bytes_per_idle_subject=per_subject_bytes(rss_before, rss_idle, args.subjects),
            )
            if not args.no_restart:
                stopping = time.monotonic()
                server.stop()
                started = time.monotonic()
                endpoint = server.restart_keeping_data()
                out.update(stop_s=round(started - stopping, 2), restart_s=round(time.monotonic() - started, 2))
                with open(server.log_path, errors="replace") as f:
                    out["recovered"] = [line.strip()[-300:] for line in f if "store recovered" in line]
        finally:
            server.stop()
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
