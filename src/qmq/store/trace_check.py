"""Checks an I/O trace (fileio.py) for answers that went out before they were durable.

An ``answer`` line says a send was answered under ``flush = "sync"`` with its bytes ending at
byte ``pos`` of a segment file; an ``ack`` line says the same of an ack, whose records end
there in the broker's action log, and a ``pull`` line the same of a pull that handed out
messages. Each is durable, so the answer was right, when before it:

- an fsync (or fdatasync) of that file completed that began when the file held at least
  ``pos`` bytes (and began after the file was last created, when the trace saw that), and
- every entry the trace saw made on the way to it (the file itself, a directory made for it)
  was made durable by an fsync of its directory that began after the entry was made and
  completed before the answer.

Every answer that fails either is a violation. Pure functions over the lines; for the
campaign and for a person: ``python -m qmq.store.trace_check <trace file>`` prints the
figures and each violation, and exits 1 when there is one.
"""

from __future__ import annotations

import bisect
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path


@dataclass(frozen=True, slots=True)
class Sync:
    kind: str  # fsync, fdatasync, dirsync, syncfs
    start_ns: int
    end_ns: int
    size: int  # bytes of the file when the fsync began; -1 for a directory or a file system
    path: str


@dataclass(frozen=True, slots=True)
class Answer:
    ns: int
    pos: int  # the send's bytes end here in ``path``
    offset: int  # ... and here in the log
    path: str
    pid: int
    what: str = "send"  # or "ack", "pull"


@dataclass(frozen=True, slots=True)
class Violation:
    answer: Answer
    reason: str

    def __str__(self) -> str:
        a = self.answer
        where = f"pid {a.pid}, log offset {a.offset}, {a.path} byte {a.pos}"
        return f"{a.what} answered at {a.ns} ns ({where}): {self.reason}"


@dataclass(slots=True)
class Trace:
    syncs: list[Sync] = field(default_factory=list)
    failed: list[Sync] = field(default_factory=list)  # size is -1: the line names the errno
    creates: dict[str, list[int]] = field(default_factory=dict)  # path -> ns of each creation
    answers: list[Answer] = field(default_factory=list)
    pids: set[int] = field(default_factory=set)
    stopped: bool = False  # the trace reached its size cap: later events are not in it
    unreadable: int = 0  # lines that are none of the above


@dataclass(slots=True)
class Report:
    answers: int
    syncs: int
    acks: int
    pulls: int
    failed_syncs: int
    stopped: bool
    unreadable: int
    violations: list[Violation]

    def summary(self) -> str:
        text = (
            f"{self.answers} answers ({self.acks} of them acks, {self.pulls} pulls) checked against "
            f"{self.syncs} fsyncs ({self.failed_syncs} failed): "
            f"{len(self.violations)} answered before they were durable"
        )
        if self.stopped:
            text += "; the trace reached its size cap, so it ends early"
        if self.unreadable:
            text += f"; {self.unreadable} unreadable line(s)"
        return text


def parse(lines: Iterable[str]) -> Trace:
    """The events of a trace's lines (any order; several processes' lines may be mixed)."""
    trace = Trace()
    for line in lines:
        if line.startswith("#"):
            if line.startswith("# stopped"):
                trace.stopped = True
            continue
        fields = line.rstrip("\n").split("\t")
        try:
            event = fields[0]
            if event in ("sync", "failed") and len(fields) == 7:
                _e, pid, kind, start, end, size, path = fields
                sync = Sync(kind, int(start), int(end), int(size) if size.isdigit() else -1, path)
                (trace.syncs if event == "sync" else trace.failed).append(sync)
            elif event == "create" and len(fields) == 4:
                _e, pid, ns, path = fields
                trace.creates.setdefault(path, []).append(int(ns))
            elif event in ("answer", "ack", "pull") and len(fields) == 6:
                _e, pid, ns, pos, offset, path = fields
                what = "send" if event == "answer" else event
                trace.answers.append(Answer(int(ns), int(pos), int(offset), path, int(pid), what))
            else:
                trace.unreadable += 1
                continue
            trace.pids.add(int(pid))
        except ValueError:
            trace.unreadable += 1
    return trace


class _Timeline:
    """Completed fsyncs by completion time, and the largest of one of their fields among those
    completed before a moment: O(log n) a question."""

    def __init__(self, syncs: list[Sync], value: str) -> None:
        syncs.sort(key=lambda s: s.end_ns)
        self.ends = [s.end_ns for s in syncs]
        self.best: list[int] = []
        top = -1
        for s in syncs:
            top = max(top, getattr(s, value))
            self.best.append(top)

    def best_before(self, ns: int) -> int:
        """The largest value among fsyncs completed before ``ns``; -1 with none."""
        i = bisect.bisect_left(self.ends, ns)
        return self.best[i - 1] if i else -1


def _timelines(trace: Trace) -> tuple[dict[tuple[str, int], _Timeline], dict[str, _Timeline]]:
    """Sizes covered per (file, how many times the trace saw it made before the fsync began), and
    the start of each directory's fsyncs (did one begin after an entry was made?)."""
    files: dict[tuple[str, int], list[Sync]] = {}
    dirs: dict[str, list[Sync]] = {}
    for s in trace.syncs:
        if s.kind == "syncfs":
            continue
        dirs.setdefault(s.path, []).append(s)
        if s.kind != "dirsync":
            made = bisect.bisect_left(trace.creates.get(s.path, ()), s.start_ns)
            files.setdefault((s.path, made), []).append(s)
    return (
        {key: _Timeline(items, "size") for key, items in files.items()},
        {path: _Timeline(items, "start_ns") for path, items in dirs.items()},
    )


def check(trace: Trace) -> Report:
    """Every answer of ``trace`` that came before the fsyncs making it durable (module docstring)."""
    for times in trace.creates.values():
        times.sort()
    files, dirs = _timelines(trace)
    violations: list[Violation] = []
    for answer in trace.answers:
        reason = _file_durable(answer, files, trace.creates) or _entries_durable(answer, dirs, trace.creates)
        if reason is not None:
            violations.append(Violation(answer, reason))
    acks = sum(a.what == "ack" for a in trace.answers)
    pulls = sum(a.what == "pull" for a in trace.answers)
    return Report(
        len(trace.answers),
        len(trace.syncs),
        acks,
        pulls,
        len(trace.failed),
        trace.stopped,
        trace.unreadable,
        violations,
    )


def _file_durable(answer: Answer, files: dict[tuple[str, int], _Timeline], creates: dict[str, list[int]]) -> str | None:
    made = bisect.bisect_left(creates.get(answer.path, ()), answer.ns)
    timeline = files.get((answer.path, made))
    best = -1 if timeline is None else timeline.best_before(answer.ns)
    if best >= answer.pos:
        return None
    if best < 0:
        return "no fsync of the file completed before it"
    return f"the fsyncs completed before it covered {best} bytes of the file, not {answer.pos}"


def _entries_durable(answer: Answer, dirs: dict[str, _Timeline], creates: dict[str, list[int]]) -> str | None:
    path = answer.path
    while True:  # bounded by the path's depth
        parent = os.path.dirname(path)
        if parent == path:
            return None
        times = creates.get(path, [])
        made = bisect.bisect_left(times, answer.ns)
        if made:
            made_ns = times[made - 1]
            timeline = dirs.get(parent)
            if timeline is None or timeline.best_before(answer.ns) <= made_ns:
                return f"{path} was made at {made_ns} ns and no fsync of {parent} made it durable before the answer"
        path = parent


def check_file(path: Path) -> Report:
    with path.open(encoding="utf-8", errors="surrogateescape") as f:
        return check(parse(f))


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m qmq.store.trace_check <trace file>", file=sys.stderr)
        return 2
    report = check_file(Path(argv[0]))
    print(report.summary())
    for v in report.violations:
        print(v)
    return 1 if report.violations else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
