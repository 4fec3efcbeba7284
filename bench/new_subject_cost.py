"""What a new subject costs the broker's store on its caller's thread (the event loop): the
first send to it (``Subjects.for_raw`` then its consume log's first append), in-process,
without a server, and the file-system calls it is made of, one by one.

``--load`` runs a thread beside it that writes 4 KiB and fdatasyncs, over and over, on the
same file system (as a broker's group commit does under flush = "sync"): under such a load a
directory or file creation waits for the file system's journal.

Prints JSON: µs per new subject (mean, p50, p99, max) for the store's path, and mean µs per
call for mkdir, open(O_CREAT) + header write, close.

    .venv/bin/python -m bench.new_subject_cost [--subjects 5000] [--load] [--dir DIR]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

from qmq.common.limits import Limits
from qmq.store.consume_log import ENTRY
from qmq.store.subjects import Subjects


def _fsync_load(directory: str, stop: threading.Event, count: list[int]) -> None:
    path = f"{directory}/load"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    block = b"x" * 4096
    try:
        while not stop.is_set():
            os.write(fd, block)
            os.fdatasync(fd)
            count[0] += 1
    finally:
        os.close(fd)


def _summary(us: list[float]) -> dict[str, float]:
    s = sorted(us)
    return {
        "mean": round(statistics.fmean(s), 1),
        "p50": round(s[len(s) // 2], 1),
        "p99": round(s[int(len(s) * 0.99)], 1),
        "max": round(s[-1], 1),
    }


def _store_path(root: Path, n: int) -> tuple[list[float], float]:
    subjects = Subjects(root / "consume", 1_000_000, Limits(), 1000)
    entry = ENTRY.pack(0, 40, 0, 0, 0)
    took = []
    t_all = time.perf_counter()
    try:
        for i in range(n):
            raw = f"grow.subject.{i:06d}".encode()
            t0 = time.perf_counter()
            st = subjects.for_raw(raw)
            st.clog.append(entry)
            took.append((time.perf_counter() - t0) * 1e6)
        seconds = time.perf_counter() - t_all
        return took, seconds
    finally:
        subjects.close()


def _calls(root: Path, n: int) -> dict[str, float]:
    base = root / "raw"
    base.mkdir()
    mk, op, cl = 0.0, 0.0, 0.0
    head = b"\0" * 16
    for i in range(n):
        d = f"{base}/s{i:06d}"
        t0 = time.perf_counter()
        os.mkdir(d)
        t1 = time.perf_counter()
        fd = os.open(f"{d}/00000000000000000000.cl", os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_TRUNC)
        os.write(fd, head)
        t2 = time.perf_counter()
        os.close(fd)
        t3 = time.perf_counter()
        mk += t1 - t0
        op += t2 - t1
        cl += t3 - t2
    return {"mkdir": round(mk / n * 1e6, 1), "create+write": round(op / n * 1e6, 1), "close": round(cl / n * 1e6, 1)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.new_subject_cost", description=__doc__.splitlines()[0])
    parser.add_argument("--subjects", type=int, default=5_000)
    parser.add_argument("--load", action="store_true", help="an fdatasync loop beside it")
    parser.add_argument("--dir", help="make the files under DIR (default: a temporary directory)")
    parser.add_argument("--no-calls", action="store_true", help="leave out the file-system calls one by one")
    args = parser.parse_args(argv)
    out: dict[str, object] = {"subjects": args.subjects, "load": args.load, "loadavg": os.getloadavg()[0]}
    with contextlib.ExitStack() as stack:
        root = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="qmq-new-subject-", dir=args.dir)))
        stop = threading.Event()
        count = [0]
        if args.load:
            t = threading.Thread(target=_fsync_load, args=(str(root), stop, count), daemon=True)
            t.start()
            stack.callback(t.join)
            stack.callback(stop.set)
            time.sleep(0.2)
        took, seconds = _store_path(root, args.subjects)
        out["store_us"] = _summary(took)
        out["new_subjects_per_s"] = round(args.subjects / seconds, 1)
        if not args.no_calls:
            out["calls_us"] = _calls(root, args.subjects)
        if args.load:
            out["load_fdatasyncs"] = count[0]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
