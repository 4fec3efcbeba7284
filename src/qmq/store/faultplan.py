"""Fault plans for the file-I/O seam (fileio.py): which calls fail, or wait, and how.

A plan is a list of rules, in JSON a list or ``{"rules": [...]}``::

    {"rules": [
      {"op": "fsync", "path": "log/*.log", "after": 5, "times": 1, "errno": "EIO"},
      {"op": "write", "path": "wal/*.log", "errno": "ENOSPC"},
      {"op": "read", "path": "/data/broker/consume/*", "delay_ms": 200}
    ]}

    | field    | meaning                                                                      |
    |----------|------------------------------------------------------------------------------|
    | op       | the calls it applies to, one of OPS (below)                                  |
    | path     | a glob (``*`` also matches ``/``): absolute, matched against the file's whole |
    |          | path, or relative, matched against its end (``log/*.log`` matches            |
    |          | ``<any data dir>/log/00000000000000000000.log``); omitted: every path         |
    | after    | pass the first N calls the rule matches (default 0)                          |
    | times    | then act on K calls, and pass the rest (omitted: every later call)           |
    | errno    | the error those calls fail with: a name (``"EIO"``, ``"ENOSPC"``) or number  |
    | delay_ms | those calls first wait this long (a slow disk); with no errno they then run  |

A rule needs ``errno`` or ``delay_ms``. Every rule counts every call it matches; the first
rule that acts on a call decides it. Ops, and the calls each covers:

    open      opening a file or directory (reading a whole file opens it too)
    read      pread, reading a whole file
    write     a write of a buffer (one call however many ``write(2)`` it takes); a new
              segment's 16-byte header is a write of its own
    fsync     fsync and fdatasync, of files and of directories
    syncfs    syncfs of a file system, and sync()
    truncate  ftruncate and truncate
    rename    rename/replace (the rule's path may name the old or the new name)
    unlink    unlink and rmdir
    mkdir     creating a directory
    listdir   listing a directory

A failed call raises ``OSError(errno, "<strerror> (injected by the fault plan: rule N)",
path)`` before touching the file. A plan is installed in-process with ``fileio.install`` or
``fileio.faults``, or by a server from ``QMQ_FAULT_PLAN=<file>`` when its store opens (a
missing or bad file stops it from starting); that file is read again whenever it changes,
looked at at most every 100 ms, so the campaign starts or stops a fault in a running server
by writing a new file and renaming it over the old. Counts start again with each new plan, and
each process counts its own calls (``qmq standalone`` passes the variable to every role: a rule's
path tells them apart, e.g. ``wal/*.log`` is the delay server's); a changed file that does not
parse is logged and the last plan stays.
"""

from __future__ import annotations

import errno as errno_codes
import fnmatch
import json
import logging
import os
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

OPS = ("open", "read", "write", "fsync", "syncfs", "truncate", "rename", "unlink", "mkdir", "listdir")
PLAN_ENV = "QMQ_FAULT_PLAN"
_RELOAD_INTERVAL_NS = 100_000_000
_RULES_MAX = 1_000
_DELAY_MS_MAX = 600_000


@dataclass(slots=True)
class FaultRule:
    """One rule of a plan (see the module docstring); ``seen`` and ``acted`` count its calls."""

    op: str
    path: str | None = None
    after: int = 0
    times: int | None = None
    errno: int | None = None
    delay_ms: int = 0
    seen: int = 0
    acted: int = 0

    def matches(self, op: str, paths: Sequence[str]) -> bool:
        if op != self.op:
            return False
        pattern = self.path
        if pattern is None:
            return True
        if not pattern.startswith("/"):
            pattern = "*/" + pattern
        return any(fnmatch.fnmatchcase(p, pattern) for p in paths)


class FaultPlan:
    """Rules, checked in order against every call of the seam while installed."""

    def __init__(self, rules: Sequence[FaultRule]) -> None:
        if len(rules) > _RULES_MAX:
            raise ValueError(f"a fault plan of {len(rules)} rules; at most {_RULES_MAX}")
        self.rules = list(rules)

    @classmethod
    def parse(cls, doc: object) -> FaultPlan:
        """A plan from its JSON document; ValueError naming the rule and field that is wrong."""
        if isinstance(doc, Mapping):
            doc = doc.get("rules")
        if not isinstance(doc, list):
            raise ValueError('a fault plan is a list of rules, or {"rules": [...]}')
        return cls([_rule(i, item) for i, item in enumerate(doc)])

    def check(self, op: str, paths: Sequence[str]) -> tuple[int, FaultRule] | None:
        """The rule that acts on this call (its index too), counting the call in every rule it matches."""
        chosen: tuple[int, FaultRule] | None = None
        with _lock:
            for i, rule in enumerate(self.rules):
                if not rule.matches(op, paths):
                    continue
                rule.seen += 1
                if chosen is None and rule.seen > rule.after and (rule.times is None or rule.acted < rule.times):
                    rule.acted += 1
                    chosen = (i, rule)
        return chosen


def _rule(i: int, item: object) -> FaultRule:
    def bad(text: str) -> ValueError:
        return ValueError(f"fault plan rule {i}: {text}")

    if not isinstance(item, Mapping):
        raise bad(f"{item!r} is not an object")
    unknown = set(item) - {"op", "path", "after", "times", "errno", "delay_ms"}
    if unknown:
        raise bad(f"unknown field(s) {sorted(unknown)}; a rule has op, path, after, times, errno, delay_ms")
    op = item.get("op")
    if op not in OPS:
        raise bad(f"op {op!r} is not one of {', '.join(OPS)}")
    path = item.get("path")
    if path is not None and (not isinstance(path, str) or not path):
        raise bad(f"path {path!r} must be a non-empty glob")

    def count(name: str, default: int | None, top: int) -> int | None:
        value = item.get(name, default)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= top:
            raise bad(f"{name} {value!r} must be a whole number from 0 to {top}")
        return value

    number: int | None = None
    name = item.get("errno")
    if isinstance(name, str):
        number = getattr(errno_codes, name, None) if name.startswith("E") else None
        if not isinstance(number, int):
            raise bad(f"errno {name!r} is not an errno name such as EIO or ENOSPC")
    elif name is not None:
        number = count("errno", None, 4095)
    delay_ms = count("delay_ms", 0, _DELAY_MS_MAX) or 0
    if number is None and not delay_ms:
        raise bad("it needs errno (the error to fail with) or delay_ms (how long to slow the call)")
    return FaultRule(str(op), path, count("after", 0, 2**62) or 0, count("times", None, 2**62), number, delay_ms)


_lock = threading.Lock()  # rule counts and the plan's reloads: the flusher thread calls the seam too
_plan: FaultPlan | None = None
_plan_file: Path | None = None  # a plan read from a file (QMQ_FAULT_PLAN) is read again when it changes
_plan_file_id: tuple[int, int, int] | None = None
_plan_looked_ns = 0


def install(plan: FaultPlan | None) -> None:
    """Make ``plan`` (None: none) the plan of this process, replacing any other."""
    global _plan, _plan_file
    with _lock:
        _plan, _plan_file = plan, None


def install_file(path: Path) -> FaultPlan:
    """Make the plan in the file ``path`` the plan of this process, read again whenever the file
    changes (looked at most every 100 ms); OSError or ValueError when it cannot be used."""
    global _plan, _plan_file, _plan_file_id, _plan_looked_ns
    plan, file_id = _read_plan(path)
    with _lock:
        _plan, _plan_file, _plan_file_id, _plan_looked_ns = plan, path, file_id, time.monotonic_ns()
    log.warning("file I/O faults from %s: %d rule(s)", path, len(plan.rules))
    return plan


def installed() -> bool:
    """Whether a plan (or a plan's file, even one with no rules now) is installed."""
    return _plan is not None or _plan_file is not None


def _read_plan(path: Path) -> tuple[FaultPlan, tuple[int, int, int]]:
    with path.open("rb") as f:
        st = os.fstat(f.fileno())
        raw = f.read()
    try:
        doc = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"not JSON: {exc}") from None
    return FaultPlan.parse(doc), (st.st_ino, st.st_mtime_ns, st.st_size)


def _reload(now_ns: int) -> None:
    """Read the plan's file again if it changed (a deleted file: no rules)."""
    global _plan, _plan_file_id, _plan_looked_ns
    path = _plan_file
    if path is None:
        return
    with _lock:
        if now_ns - _plan_looked_ns < _RELOAD_INTERVAL_NS:
            return
        _plan_looked_ns = now_ns
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if _plan_file_id is not None:
            log.warning("fault plan %s is gone: no faults", path)
            _plan, _plan_file_id = None, None
        return
    if (st.st_ino, st.st_mtime_ns, st.st_size) == _plan_file_id:
        return
    try:
        plan, file_id = _read_plan(path)
    except (OSError, ValueError) as exc:
        log.error("fault plan %s changed but cannot be used (%s); the last one stays", path, exc)
        _plan_file_id = (st.st_ino, st.st_mtime_ns, st.st_size)
        return
    _plan, _plan_file_id = plan, file_id
    log.warning("file I/O faults from %s changed: %d rule(s)", path, len(plan.rules))


def act(op: str, *paths: str) -> None:
    """Act on a call as the plan says: wait, fail, or nothing."""
    if _plan_file is not None:
        _reload(time.monotonic_ns())
    plan = _plan
    if plan is None:
        return
    hit = plan.check(op, paths)
    if hit is None:
        return
    i, rule = hit
    if rule.delay_ms:
        time.sleep(rule.delay_ms / 1000)
    if rule.errno is not None:
        raise OSError(rule.errno, f"{os.strerror(rule.errno)} (injected by the fault plan: rule {i})", paths[0])
