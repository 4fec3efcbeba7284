"""W3 alone, paired: where qmq's end-to-end latency tail under flush = "sync" comes from.

Runs `python -m bench run --only W3 --peers "" --qmq-flush sync --repeats 1` once per variant
and round, the variants alternating (A B A B ...), so a machine loaded by other work weighs on
each alike. A variant is a label and what differs: a source tree put first on PYTHONPATH (an
older commit's ``src``, e.g. from ``git archive COMMIT src | tar -x -C DIR``) and/or
environment variables. Each run's result files are moved to ``--out`` (scratch, never
bench/results). Per run it prints p50 / p99 / p99.9, the p99 of each second of send time,
the broker's CPU s per 100k messages, how many flushes the group commit made and the share of
them that took over 1 and 5 ms (the broker's own histogram: from the flush's start on the
loop to its return there, so the hand-offs to and from the fsync threads count, not only the
fsync), and the load average at the start (the machine is shared: read the figures beside it).

``--tmpfs`` puts the servers' data on /dev/shm, where an fsync costs next to nothing: what is
left of the tail is the software's and the machine's (CPU contention, thread hand-offs).

    .venv/bin/python -m bench.w3_tail --variant head= --variant old=PYTHONPATH=/tmp/old/src [--rounds 3] [--tmpfs]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from typing import Any

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_RESULTS_LINE = re.compile(r"^results: (\S+\.json)$", re.MULTILINE)
RUN_LIMIT_S = 300


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``label=`` or ``label=NAME=VALUE[,NAME=VALUE...]`` (environment of that variant's runs)."""
    label, sep, rest = text.partition("=")
    if not sep or not label:
        raise argparse.ArgumentTypeError(f"variant {text!r}: write LABEL= or LABEL=NAME=VALUE[,NAME=VALUE]")
    env: dict[str, str] = {}
    for item in filter(None, rest.split(",")):
        name, eq, value = item.partition("=")
        if not eq or not name:
            raise argparse.ArgumentTypeError(f"variant {text!r}: {item!r} is not NAME=VALUE")
        env[name] = value
    return label, env


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """The figures of one run's W3 (qmq-sync) out of its result document."""
    system = doc["systems"]["qmq-sync"]
    w3 = system["workloads"]["W3"][0]
    latency = w3["latency_ms"]
    flushes = w3.get("server_fsync_le_s") or {}
    total = flushes.get("+Inf", 0)

    def over(bound: str) -> float | None:
        return None if not total else round(100 * (total - flushes.get(bound, total)) / total, 2)

    return {
        "p50": latency["p50"],
        "p99": latency["p99"],
        "p999": latency["p999"],
        "max": latency["max"],
        "p99_by_second": [round(s["p99"], 1) for s in w3.get("latency_by_send_second", [])],
        "server_cpu_s_per_100k": w3["server"].get("server_cpu_s_per_100k"),
        "flushes": total,
        "flushes_over_1ms_pct": over("0.001"),
        "flushes_over_5ms_pct": over("0.005"),
        "load_avg_at_start": doc["machine"]["load_avg_at_start"],
    }


def run_once(env_extra: dict[str, str], data_tmp: str | None, out_dir: str) -> dict[str, Any]:
    env = dict(os.environ)
    for name, value in env_extra.items():
        env[name] = f"{value}{os.pathsep}{env[name]}" if name == "PYTHONPATH" and env.get(name) else value
    if data_tmp is not None:
        env["TMPDIR"] = data_tmp
    cmd = [sys.executable, "-m", "bench", "run", "--only", "W3", "--peers", "", "--qmq-flush", "sync", "--repeats", "1"]
    done = subprocess.run(cmd, cwd=_REPO_ROOT, env=env, capture_output=True, text=True, timeout=RUN_LIMIT_S)
    found = _RESULTS_LINE.search(done.stdout)
    if done.returncode != 0 or found is None:
        tail = (done.stderr or done.stdout).strip().splitlines()[-5:]
        raise RuntimeError(f"W3 run failed (exit {done.returncode}): {' | '.join(tail)}")
    path = found.group(1)
    with open(path) as f:
        doc = json.load(f)
    for suffix in (".json", ".md"):
        moved = path[: -len(".json")] + suffix
        if os.path.exists(moved):
            shutil.move(moved, os.path.join(out_dir, os.path.basename(moved)))
    return summarize(doc)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.w3_tail", description=__doc__.splitlines()[0])
    parser.add_argument("--variant", action="append", type=parse_variant, required=True,
                        help="LABEL= (this tree) or LABEL=PYTHONPATH=DIR,NAME=VALUE; give two or more")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--tmpfs", action="store_true", help="servers' data on /dev/shm (fsync next to free)")
    parser.add_argument("--out", default=None, help="where the runs' result files go (default: a temp dir)")
    parser.add_argument("--json", action="store_true", help="print every run's figures as one JSON document")
    args = parser.parse_args(argv)
    out_dir = args.out or tempfile.mkdtemp(prefix="qmq-w3-tail-")
    os.makedirs(out_dir, exist_ok=True)
    data_tmp = tempfile.mkdtemp(prefix="qmq-w3-", dir="/dev/shm") if args.tmpfs else None
    runs: dict[str, list[dict[str, Any]]] = {label: [] for label, _env in args.variant}
    try:
        for round_no in range(1, max(1, args.rounds) + 1):
            for label, env in args.variant:
                figures = run_once(env, data_tmp, out_dir)
                runs[label].append(figures)
                print(f"round {round_no} {label}: p50 {figures['p50']:.2f} p99 {figures['p99']:.2f} "
                      f"p99.9 {figures['p999']:.2f} ms; server CPU {figures['server_cpu_s_per_100k']} s/100k; "
                      f"{figures['flushes']} flushes, {figures['flushes_over_1ms_pct']}% > 1 ms, "
                      f"{figures['flushes_over_5ms_pct']}% > 5 ms; load {figures['load_avg_at_start']}", flush=True)
                print(f"    p99 by second: {' '.join(str(v) for v in figures['p99_by_second'])}", flush=True)
    finally:
        if data_tmp is not None:
            shutil.rmtree(data_tmp, ignore_errors=True)
    print("\nmedians:")
    for label, of_label in runs.items():
        if of_label:
            med = {k: statistics.median(f[k] for f in of_label)
                   for k in ("p50", "p99", "p999", "server_cpu_s_per_100k", "flushes")}
            print(f"  {label}: p50 {med['p50']:.2f} p99 {med['p99']:.2f} p99.9 {med['p999']:.2f} ms, "
                  f"server CPU {med['server_cpu_s_per_100k']:.2f} s/100k, {med['flushes']:.0f} flushes "
                  f"({len(of_label)} runs)")
    if args.json:
        print(json.dumps(runs))
    print(f"result files: {out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
