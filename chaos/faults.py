"""Fault plans for running servers (QMQ_FAULT_PLAN, qmq.store.faultplan): one plan file every
process of a scenario reads, replaced whole (write, rename) to start or stop a fault."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any


class PlanFile:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.set([])

    @property
    def env(self) -> dict[str, str]:
        return {"QMQ_FAULT_PLAN": str(self.path)}

    def set(self, rules: Sequence[Mapping[str, Any]]) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"rules": list(rules)}), encoding="utf-8")
        os.replace(tmp, self.path)
