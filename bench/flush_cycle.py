"""What one flush of the broker's group commit costs by itself: wall time and CPU per flush.

Under flush = "sync" the broker flushes back to back while writes wait (W3 at 5,000 msg/s: up
to ~2,000 flushes a second on a quiet disk), so the cost of one flush, apart from the fsyncs
themselves, is paid that often: the hand-off from the event loop to the fsync thread and back,
and, when a flush covers both logs, the second log's fsync on a thread of its own
(serving/group_commit.py). This runs ``GroupCommit.flush_once`` back to back on an asyncio
(uvloop) loop over two files in ``--dir``, a few bytes appended to each before every flush:

- ``two``: a ticket of both logs, as a flush of sends and pulls (the two fdatasyncs at once, on
  two threads);
- ``message``: a ticket of the message log alone, as a flush of sends only (one thread);
- ``actions``: a ticket of the action log alone, as a flush of acks and pulls only;
- ``serial``: both files fdatasynced one after the other on one thread (what the second thread
  saves on a disk whose fdatasync waits for a journal commit).

It prints, per mode, the median over ``--rounds`` (alternating) of the wall time and of this
process's CPU time (user + system) per flush. On /dev/shm an fdatasync costs next to nothing:
what is left is the hand-offs.

    .venv/bin/python -m bench.flush_cycle [--dir /dev/shm] [--flushes 3000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import tempfile
import time

import uvloop

from qmq.serving.group_commit import GroupCommit
from qmq.store.segments import FlushTicket

MODES = ("two", "message", "actions", "serial")
_WARM_UP_FLUSHES = 200


async def _flushes(directory: str, mode: str, count: int) -> tuple[float, float]:
    """(wall s, CPU s) per flush over ``count`` flushes in ``mode``."""
    a = os.open(os.path.join(directory, f"message-{mode}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    b = os.open(os.path.join(directory, f"action-{mode}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    flushed = 0

    def begin() -> FlushTicket:
        nonlocal flushed
        flushed += 1
        os.write(a, b"m" * 120)
        if mode == "message":
            return FlushTicket([os.dup(a)], flushed)
        os.write(b, b"p" * 40)
        if mode == "actions":
            return FlushTicket([], flushed, None, -1, flushed, [os.dup(b)])
        if mode == "serial":
            return FlushTicket([os.dup(a), os.dup(b)], flushed)
        return FlushTicket([os.dup(a)], flushed, None, -1, flushed, [os.dup(b)])

    commit = GroupCommit("bench files", begin, lambda _t: None, lambda _s: None, lambda _e: None)
    try:
        for _ in range(_WARM_UP_FLUSHES):
            await commit.flush_once()
        before = resource.getrusage(resource.RUSAGE_SELF)
        t0 = time.perf_counter()
        for _ in range(count):
            await commit.flush_once()
        wall = time.perf_counter() - t0
        after = resource.getrusage(resource.RUSAGE_SELF)
    finally:
        await commit.stop()
        os.close(a)
        os.close(b)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall / count, cpu / count


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.flush_cycle", description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the two files go (default: a temp dir)")
    parser.add_argument("--flushes", type=int, default=3000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--modes", default=",".join(MODES))
    args = parser.parse_args(argv)
    modes = [m for m in args.modes.split(",") if m]
    unknown = [m for m in modes if m not in MODES]
    if unknown:
        parser.error(f"unknown mode(s) {unknown}: choose from {', '.join(MODES)}")
    figures: dict[str, list[tuple[float, float]]] = {m: [] for m in modes}
    with tempfile.TemporaryDirectory(prefix="qmq-flush-cycle-", dir=args.dir) as directory:
        for _ in range(max(1, args.rounds)):
            for mode in modes:
                figures[mode].append(uvloop.run(_flushes(directory, mode, args.flushes)))
    print(f"{args.flushes} flushes x {args.rounds} rounds in {args.dir or tempfile.gettempdir()}; "
          f"load average {os.getloadavg()[0]:.2f}")
    for mode, runs in figures.items():
        wall = statistics.median(w for w, _c in runs) * 1e6
        cpu = statistics.median(c for _w, c in runs) * 1e6
        print(f"  {mode:8s} wall {wall:7.0f} us/flush   CPU {cpu:6.0f} us/flush   "
              f"(CPU by round: {', '.join(f'{c * 1e6:.0f}' for _w, c in runs)})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
