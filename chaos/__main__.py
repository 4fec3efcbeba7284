"""``python -m chaos run [--quick] [--only process,disk] [--keep]``

Runs each selected fault scenario against real qmq processes (data under a temp dir), checks
every worker's history, writes chaos/results/<stamp>.json and .md and prints the table. Exits
3 when a scenario lost, repeated after an ack, delivered early, or could not run (a finding;
the table says which); 1 when the campaign itself failed, 2 for a usage error."""

from __future__ import annotations

import argparse
import importlib
import logging
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from types import FrameType

from chaos.results import table, write
from chaos.scenario import Result, Settings

SCENARIOS = ("process", "disk", "corruption", "power", "hostile", "hostile_auth", "network")
EXIT_FINDINGS = 3


def _log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _interrupted(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt  # scenarios clean up in their finally blocks


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m chaos", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the fault scenarios")
    run.add_argument("--quick", action="store_true", help="every scenario once, small counts (a few minutes)")
    run.add_argument("--only", default=",".join(SCENARIOS), help=f"scenarios, from {','.join(SCENARIOS)}")
    run.add_argument("--keep", action="store_true", help="keep the data and logs of the run (printed at the end)")
    run.add_argument("--results-dir", type=Path, default=None, help="where to write <stamp>.json and .md")
    args = parser.parse_args(argv)
    only = [s.strip() for s in args.only.split(",") if s.strip()]
    unknown = [s for s in only if s not in SCENARIOS]
    if unknown:
        parser.error(f"unknown scenario(s) {unknown}: choose from {', '.join(SCENARIOS)}")
    signal.signal(signal.SIGTERM, _interrupted)
    logging.getLogger("qmq").setLevel(logging.ERROR)  # the SDK's notes of in-process steps: not the table's

    work = Path(tempfile.mkdtemp(prefix="qmq-chaos-"))
    settings = Settings(args.quick, work, _log)
    results: list[Result] = []
    command = "python -m chaos run" + (" --quick" if args.quick else "")
    if "--only" in argv:
        command += f" --only {args.only}"
    try:
        for name in only:
            _log(f"scenario {name}")
            module = importlib.import_module(f"chaos.scenarios.{name}")
            for r in module.run(settings):
                f = r.figures
                _log(f"  {r.scenario}: {r.fault_count} faults, {f.sent} sent, {f.acked} acked, {f.lost} lost, "
                     f"{f.duplicated_after_ack} duplicated after ack, {f.early} early"
                     + (f", error: {r.error}" if r.error else "") + f" ({r.duration_s:.0f} s)")
                results.append(r)
    except KeyboardInterrupt:
        _log("interrupted; the scenario in progress stopped what it started")
    finally:
        if args.keep:
            _log(f"data and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    path = write(results, args.quick, command, *([args.results_dir] if args.results_dir else []))
    print(table(results))
    print(f"results: {path} and {path.with_suffix('.json')}")
    return 0 if results and all(r.ok() for r in results) and len(results) >= len(only) else EXIT_FINDINGS


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
