"""The results of a run: ``chaos/results/<stamp>.json`` (everything) and ``.md`` (the table)."""

from __future__ import annotations

import json
import platform
import time
from collections.abc import Sequence
from pathlib import Path

from chaos.scenario import Result

RESULTS_DIR = Path(__file__).resolve().parent / "results"
HEADER = (
    "| scenario | faults injected | sent / acked | lost | duplicated after ack | early | recovery (s) | "
    "operator command | ok |\n|---|---|---|---|---|---|---|---|---|\n"
)


def table(results: Sequence[Result]) -> str:
    rows = []
    for r in results:
        f = r.figures
        dup = f"{f.duplicated_after_ack}" + (f" ({r.duplicates_allowed})" if r.duplicates_allowed else "")
        ok = "yes" if r.ok() else f"**no**{': ' + r.error if r.error else ''}"
        rows.append(
            f"| {r.scenario} | {r.fault_count}: {r.faults} | {f.sent} / {f.acked} | {f.lost} | "
            f"{dup} | {f.early} | {r.recovery_s:.1f} | {r.command} | {ok} |\n"
        )
    return HEADER + "".join(rows)


def write(results: Sequence[Result], quick: bool, command: str, out_dir: Path = RESULTS_DIR) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    doc = {
        "stamp": stamp,
        "command": command,
        "quick": quick,
        "machine": {"python": platform.python_version(), "kernel": platform.release(), "cpus": _cpus()},
        "results": [r.as_dict() for r in results],
    }
    (out_dir / f"{stamp}.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    notes = "".join(
        f"- **{r.scenario}**: " + "; ".join([*r.notes, *r.figures.examples] or ["-"]) + f" ({r.duration_s:.0f} s)\n"
        for r in results
    )
    md = f"# Fault campaign {stamp}\n\n`{command}`\n\n{table(results)}\n{notes}"
    path = out_dir / f"{stamp}.md"
    path.write_text(md, encoding="utf-8")
    return path


def _cpus() -> int:
    import os

    return os.cpu_count() or 0
