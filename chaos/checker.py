"""The checker: reads every worker's history (history.py) and counts what broke a promise.

- **lost**: an acknowledged send that some consumer group never received;
- **duplicated after ack**: a delivery to a group of a message (id and attempt) whose ack that
  group had already seen answered as done;
- **early**: a delay message received before its due time.

It also counts what is allowed but worth knowing: sends whose answer never came (the send may
or may not be stored), deliveries repeated before an ack was answered.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

_EXAMPLES_MAX = 10


@dataclass(slots=True)
class Figures:
    sent: int = 0
    acked: int = 0
    delivered: int = 0  # deliveries, all groups, repeats included
    lost: int = 0
    duplicated_after_ack: int = 0
    early: int = 0
    redelivered_before_ack: int = 0
    unanswered_sends: int = 0
    examples: list[str] = field(default_factory=list)

    def ok(self) -> bool:
        return self.lost == 0 and self.duplicated_after_ack == 0 and self.early == 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)

    def example(self, text: str) -> None:
        if len(self.examples) < _EXAMPLES_MAX:
            self.examples.append(text)


@dataclass(slots=True)
class History:
    """Everything the workers wrote, folded as it is read."""

    kinds: dict[str, tuple[str, int]] = field(default_factory=dict)  # id -> (kind, due_ms)
    acked: dict[str, int] = field(default_factory=dict)  # id -> ms of the answer
    # (group, id) -> [(times, ms)] of each delivery
    delivered: dict[tuple[str, str], list[tuple[int, int]]] = field(default_factory=dict)
    answered: dict[tuple[str, str, int], int] = field(default_factory=dict)  # (group, id, times) -> first answer ms
    # (group, id, times, ms of the delivery) -> "broker group#sequence" it came from
    origins: dict[tuple[str, str, int, int], str] = field(default_factory=dict)
    unreadable: int = 0

    def read_lines(self, lines: Iterable[str]) -> None:
        for line in lines:
            f = line.rstrip("\n").split("\t")
            try:
                if f[0] == "S" and len(f) == 4:
                    self.kinds[f[1]] = (f[2], int(f[3]))
                elif f[0] == "A" and len(f) == 3:
                    self.acked.setdefault(f[1], int(f[2]))
                elif f[0] == "D" and len(f) == 5:
                    self.delivered.setdefault((f[1], f[2]), []).append((int(f[3]), int(f[4])))
                elif f[0] == "W" and len(f) == 7:
                    self.origins[(f[1], f[2], int(f[3]), int(f[4]))] = f"{f[5]}#{f[6]}"
                elif f[0] == "K" and len(f) == 5:
                    key = (f[1], f[2], int(f[3]))
                    ms = int(f[4])
                    if key not in self.answered or ms < self.answered[key]:
                        self.answered[key] = ms
                else:
                    self.unreadable += 1  # a line cut by a kill is the only expected one
            except ValueError:
                self.unreadable += 1

    def read_files(self, paths: Iterable[Path]) -> None:
        for path in paths:
            if path.exists():
                with path.open(encoding="utf-8", errors="replace") as f:
                    self.read_lines(f)

    def missing(self, groups: Sequence[str]) -> list[tuple[str, str]]:
        """(group, id) of every acknowledged send not yet delivered to that group."""
        return [(g, i) for i in self.acked for g in groups if (g, i) not in self.delivered]


def check(history: History, groups: Sequence[str]) -> Figures:
    fig = Figures(sent=len(history.kinds), acked=len(history.acked))
    fig.unanswered_sends = sum(1 for i in history.kinds if i not in history.acked)
    for group, mid in history.missing(groups):
        fig.lost += 1
        fig.example(f"lost: {mid} ({history.kinds.get(mid, ('?', 0))[0]}) acknowledged, never delivered to {group}")
    for (group, mid), deliveries in history.delivered.items():
        fig.delivered += len(deliveries)
        kind, due_ms = history.kinds.get(mid, ("?", 0))
        seen: set[int] = set()
        for times, ms in sorted(deliveries, key=lambda d: d[1]):
            answered = history.answered.get((group, mid, times))
            if answered is not None and ms > answered:
                fig.duplicated_after_ack += 1
                fig.example(
                    f"duplicated after ack: {mid} attempt {times} to {group} at {ms}, ack answered at {answered}"
                    + _origins(history, group, mid, times, deliveries)
                )
            elif times in seen:
                fig.redelivered_before_ack += 1
            seen.add(times)
            if kind == "delay" and times == 1 and ms < due_ms:
                fig.early += 1
                fig.example(f"early: {mid} due at {due_ms} received by {group} at {ms}")
    return fig


@dataclass(slots=True)
class Allowance:
    """What a power loss under ``flush = "periodic"`` may cost, told apart from what it may not."""

    lost_within: int = 0  # (group, id) never delivered, acknowledged within the window before a cut
    lost_beyond: int = 0
    again_within: int = 0  # deliveries again after an ack answered, excused by a cut (see periodic_allowance)
    again_beyond: int = 0
    examples: list[str] = field(default_factory=list)


def periodic_allowance(history: History, groups: Sequence[str], cut_ms: Sequence[int], window_ms: int) -> Allowance:
    """Sort each loss and each delivery after an answered ack into allowed by the periodic flush
    policy or not. A power cut may undo what the servers wrote within ``window_ms`` before it
    (``flush_interval_ms`` and the fsync that follows). So allowed are:

    - a send acknowledged within the window before a cut, never delivered;
    - a delivery again after an ack that was answered within the window before a cut (the ack
      undone);
    - a delivery again after an ack answered after a cut, when the delivery that ack was for came
      within the window before that cut: the pull that handed it out was undone, so the ack, made
      after the restart, names pull-log positions the broker no longer holds, and does not take.
    """
    cuts = sorted(cut_ms)

    def cut_after(ms: int) -> int | None:
        """The first cut at or after ``ms``."""
        i = bisect.bisect_left(cuts, ms)
        return cuts[i] if i < len(cuts) else None

    def within(ms: int) -> bool:
        cut = cut_after(ms)
        return cut is not None and cut - ms <= window_ms

    out = Allowance()
    for _group, mid in history.missing(groups):
        if within(history.acked[mid]):
            out.lost_within += 1
        else:
            out.lost_beyond += 1
    for (group, mid), deliveries in history.delivered.items():
        ordered = sorted(deliveries, key=lambda d: d[1])
        for i, (times, ms) in enumerate(ordered):
            answered = history.answered.get((group, mid, times))
            if answered is None or ms <= answered:
                continue
            # the delivery the ack was for: the last of this attempt before the ack was answered
            first = max((d_ms for t, d_ms in ordered[:i] if t == times and d_ms <= answered), default=ms)
            cut = cut_after(first)
            if within(answered) or (cut is not None and cut - first <= window_ms and answered >= cut):
                out.again_within += 1
            else:
                out.again_beyond += 1
                if len(out.examples) < _EXAMPLES_MAX:
                    out.examples.append(
                        f"again after ack: {mid} attempt {times} to {group} delivered at {first}, "
                        f"ack answered at {answered}, again at {ms}; cuts at {list(cuts)}"
                    )
    return out


def _origins(history: History, group: str, mid: str, times: int, deliveries: list[tuple[int, int]]) -> str:
    """``; copies from b1#12, b2#7``: where each delivery of that attempt came from, when recorded."""
    places = [history.origins.get((group, mid, t, ms), "?") for t, ms in sorted(deliveries, key=lambda d: d[1])
              if t == times]
    return f"; copies from {', '.join(places)}" if any(p != "?" for p in places) else ""
