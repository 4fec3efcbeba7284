"""`python -m bench run [--quick] [--only W1,W3] [--peers rabbitmq,nats,redis] [--qmq-flush sync,periodic]`

Starts every selected server on loopback (data under a temp dir), runs every selected
workload against each, stops every server by PID (also on Ctrl-C and SIGTERM), writes
bench/results/<stamp>.json and .md, updates bench/results/latest.md (when every workload ran
against every system) and prints the tables."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from types import FrameType
from typing import Any

from bench.machine import machine, versions
from bench.report import markdown
from bench.runner import SystemRun
from bench.settings import PEERS, QMQ_FLUSH_POLICIES, WORKLOADS, Settings
from bench.workers import kill_all_workers

RESULTS_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _csv(value: str, allowed: tuple[str, ...], what: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()] if value else []
    unknown = [v for v in items if v not in allowed]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown {what} {unknown}: choose from {', '.join(allowed)}")
    return items


def parse_args(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the workloads against qmq and its peers")
    run.add_argument("--quick", action="store_true", help="small counts and short durations (< 5 min)")
    run.add_argument("--only", default=",".join(WORKLOADS), type=lambda v: _csv(v, WORKLOADS, "workload"),
                     help="workloads, e.g. W1,W3 (W2 always runs W1 first for its backlog)")
    run.add_argument("--peers", default=",".join(PEERS), type=lambda v: _csv(v, PEERS, "peer"),
                     help="peers to run; empty for none")
    run.add_argument("--qmq-flush", default=",".join(QMQ_FLUSH_POLICIES),
                     type=lambda v: _csv(v, QMQ_FLUSH_POLICIES, "flush policy"),
                     help="qmq flush policies to run; empty for no qmq")
    run.add_argument("--repeats", type=int, default=None, help="runs of W1/W2 and W3 (default 1)")
    run.add_argument("--event-loop", choices=("uvloop", "asyncio"), default=None,
                     help="event loop of the client processes (default uvloop, for every system alike)")
    run.add_argument("--rabbitmq-queue-type", choices=("quorum", "classic"), default=None)
    run.add_argument("--keep-logs", action="store_true", help="keep the temp dir of logs even on success")
    return parser.parse_args(argv)


def build_settings(args: argparse.Namespace) -> Settings:
    settings = Settings.for_quick() if args.quick else Settings.full()
    changes: dict[str, Any] = {}
    if args.repeats is not None:
        changes["repeats"] = max(1, args.repeats)
    if args.event_loop is not None:
        changes["event_loop"] = args.event_loop
    if args.rabbitmq_queue_type is not None:
        changes["rabbitmq_queue_type"] = args.rabbitmq_queue_type
    return settings.replace(**changes) if changes else settings


class Interrupted(BaseException):
    """SIGTERM, SIGINT or the whole-run time limit: stop everything, keep what was measured."""


def _on_signal(signum: int, _frame: FrameType | None) -> None:
    raise Interrupted(f"signal {signal.Signals(signum).name}")


def run(args: argparse.Namespace) -> int:
    settings = build_settings(args)
    systems = [f"qmq-{flush}" for flush in args.qmq_flush] + list(args.peers)
    started = datetime.datetime.now()
    stamp = started.strftime("%Y-%m-%d-%H%M%S")
    tmp = tempfile.mkdtemp(prefix=f"qmqbench-{stamp}-")
    data_root = os.path.join(tmp, "data")
    log_dir = os.path.join(tmp, "logs")
    os.makedirs(data_root)
    os.makedirs(log_dir)
    _log(f"bench {'quick' if settings.quick else 'full'} run: {', '.join(systems)}; "
         f"workloads {','.join(args.only)}; logs in {log_dir}")
    doc: dict[str, Any] = {
        "started": started.isoformat(timespec="seconds"),
        "command": "python -m bench " + " ".join(sys.argv[1:]),
        "mode": "quick" if settings.quick else "full",
        "workloads": args.only,
        "settings": json.loads(settings.to_json()),
        "machine": machine(),
        "versions": versions(),
        "systems": {},
    }
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    # The whole run is bounded: past run_limit_s the main thread is interrupted like a signal.
    alarm = threading.Timer(settings.run_limit_s, lambda: os.kill(os.getpid(), signal.SIGTERM))
    alarm.daemon = True
    alarm.start()
    t0 = time.monotonic()
    current: SystemRun | None = None
    try:
        once_on = next((system for system in systems if system.startswith("qmq-")), None)
        for system in systems:
            current = SystemRun(system, settings, set(args.only), data_root, log_dir, _log, once_on)
            doc["systems"][system] = current.entry
            current.run()
            current = None
    except Interrupted as exc:
        doc["interrupted"] = str(exc)
        _log(f"interrupted ({exc}); stopping workers and servers")
    finally:
        alarm.cancel()
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        kill_all_workers()
        if current is not None:
            current.server.stop()
            current.server.remove_data()
    doc["wall_s"] = round(time.monotonic() - t0, 1)
    paths = write_results(doc, stamp)
    print(markdown(doc))
    print(f"\nresults: {paths[0]}\ntable:   {paths[1]}")
    failed = "interrupted" in doc or any(_has_failure(entry) for entry in doc["systems"].values())
    if failed or args.keep_logs:
        _log(f"logs kept in {log_dir}")
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    return 1 if "interrupted" in doc else 0


def _has_failure(entry: dict[str, Any]) -> bool:
    if entry.get("error"):
        return True
    for value in entry.get("workloads", {}).values():
        for result in value if isinstance(value, list) else [value]:
            if not result.get("ok") and "skipped" not in result:
                return True
    return False


def write_results(doc: dict[str, Any], stamp: str) -> tuple[str, str]:
    os.makedirs(RESULTS_DIR, exist_ok=True)
    json_path = os.path.join(RESULTS_DIR, f"{stamp}.json")
    md_path = os.path.join(RESULTS_DIR, f"{stamp}.md")
    with open(json_path, "w") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")
    text = markdown(doc) + "\n"
    with open(md_path, "w") as f:
        f.write(text)
    # latest.md (the table the README links) only ever shows a complete run of everything
    complete = set(doc["workloads"]) == set(WORKLOADS) and set(doc["systems"]) == {
        *(f"qmq-{flush}" for flush in QMQ_FLUSH_POLICIES), *PEERS}
    if complete and "interrupted" not in doc:
        with open(os.path.join(RESULTS_DIR, "latest.md"), "w") as f:
            f.write(text)
    return json_path, md_path


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.command == "run":
        return run(args)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
