"""Helpers of the delay tests: messages encoded as a producer would, a store on a manual clock."""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from qmq.common.clock import ManualClock
from qmq.common.config import DelayConfig
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import AppendResult, DelayStore
from qmq.protocol.message import decode_message, encode_message, scan_batch

# 2023-11-14T22:00:00Z: a whole hour, so bucket boundaries are easy to read in tests
T0_MS = 1_700_000_000_000 - 1_700_000_000_000 % 3_600_000


def encoded(subject: str, message_id: str, due_ms: int, body: bytes = b"body", times: int = 0) -> bytes:
    return encode_message(
        subject.encode(), message_id.encode(), b"", 0, b"", body, created_ms=T0_MS, deliver_at_ms=due_ms, times=times
    )


def config(data_dir: Path, **values: Any) -> DelayConfig:
    values.setdefault("bucket_ms", 60_000)
    values.setdefault("preload_ms", 5_000)
    values.setdefault("flush", "periodic")
    return DelayConfig(data_dir=data_dir, **values)


def open_store(data_dir: Path, clock: ManualClock, **values: Any) -> DelayStore:
    store = DelayStore(config(data_dir, **values), clock)
    store.open()
    return store


def append(store: DelayStore, messages: Sequence[tuple[str, str, int]], body: bytes = b"body") -> AppendResult:
    """Send ``(subject, message id, due_ms)`` messages as one frame."""
    frame = b"".join(encoded(s, mid, due, body) for s, mid, due in messages)
    return store.append(frame, scan_batch(frame))


def ids_of(encoded_messages: Sequence[bytes]) -> list[str]:
    return [decode_message(e).message_id for e in encoded_messages]


def manual_clock() -> ManualClock:
    return ManualClock(T0_MS)


def fire(sched: Scheduler, clock: ManualClock) -> list[str]:
    """Everything due now, as the dispatcher hands it over (cancelled rows dropped), acknowledged."""
    now = clock.now_ms()
    sched.load_due(now)
    rows = sched.drop_cancelled(sched.take(now, 100_000, 1 << 40))
    handover = sched.read(rows)
    for start in np.unique(handover.rows["bucket"]).tolist():
        mine = handover.rows[handover.rows["bucket"] == start]
        sched.dispatched(int(start), array("I", mine["entry"].tolist()).tobytes())
    return ids_of(handover.encoded)
