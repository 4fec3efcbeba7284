"""Wall and monotonic time behind one small interface, so tests can move time by hand."""

from __future__ import annotations

import math
import time
from typing import Protocol


class Clock(Protocol):
    def now_ms(self) -> int:
        """Milliseconds since the epoch (wall clock)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back."""
        ...


class SystemClock:
    """The real clocks."""

    def now_ms(self) -> int:
        return time.time_ns() // 1_000_000

    def monotonic(self) -> float:
        return time.monotonic()


class ManualClock:
    """A clock that only moves when told to; for tests of time-driven behaviour."""

    def __init__(self, start_ms: int = 1_700_000_000_000) -> None:
        self._now_ms = start_ms
        self._mono = 1000.0

    def now_ms(self) -> int:
        return self._now_ms

    def monotonic(self) -> float:
        return self._mono

    def advance(self, seconds: float) -> None:
        if not 0 <= seconds < math.inf:  # written so that NaN is refused too
            raise ValueError(f"a clock cannot go back or jump to no time (asked to advance by {seconds} s)")
        self._now_ms += round(seconds * 1000)
        self._mono += seconds


SYSTEM_CLOCK = SystemClock()
