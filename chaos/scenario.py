"""What every scenario shares: its result, and the end of its load (stop the producers, let
the consumers catch up, stop them, check the histories)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from chaos.checker import Figures, History, check
from chaos.cluster import GROUPS, ChaosCluster

DRAIN_TIMEOUT_S = 90.0


@dataclass
class Result:
    scenario: str
    faults: str  # what was injected, in words
    fault_count: int = 0
    figures: Figures = field(default_factory=Figures)
    recovery_s: float = 0.0  # the longest time from a fault's end to service again
    command: str = "none: comes back on its own"
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0
    error: str | None = None
    # why repeats after an answered ack are what qmq documents for this fault (empty: they are not)
    duplicates_allowed: str = ""

    def ok(self) -> bool:
        f = self.figures
        if self.duplicates_allowed:
            return self.error is None and f.lost == 0 and f.early == 0
        return self.error is None and f.ok()

    def as_dict(self) -> dict[str, Any]:
        doc = asdict(self)
        doc["ok"] = self.ok()
        return doc


@dataclass(frozen=True)
class Settings:
    quick: bool
    work_dir: Path
    log: Callable[[str], None]


def drain(cluster: ChaosCluster, log: Callable[[str], None], timeout_s: float = DRAIN_TIMEOUT_S) -> Figures:
    """Stop the producers, wait until every acknowledged send reached every group (or the
    deadline: what is missing then is lost), stop the consumers, check."""
    cluster.stop_producers()
    deadline = time.monotonic() + timeout_s
    missing: list[tuple[str, str]] = []
    while time.monotonic() < deadline:
        history = History()
        history.read_files(cluster.histories())
        missing = history.missing(GROUPS)
        if not missing:
            break
        time.sleep(1.0)  # the consumers' progress is only in their history files
    if missing:
        log(f"  {len(missing)} (group, message) pairs still undelivered after {timeout_s:.0f} s")
    cluster.stop_consumers()
    history = History()
    history.read_files(cluster.histories())
    return check(history, GROUPS)
