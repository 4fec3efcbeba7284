"""Clocks: the manual clock tests move by hand, and the system clock."""

from __future__ import annotations

import math
import time

import pytest

from qmq.common.clock import SYSTEM_CLOCK, Clock, ManualClock


def test_manual_clock_moves_only_when_told() -> None:
    clock = ManualClock(start_ms=1_000)
    mono = clock.monotonic()

    assert (clock.now_ms(), clock.monotonic()) == (1_000, mono)
    clock.advance(1.5)
    assert (clock.now_ms(), clock.monotonic()) == (2_500, mono + 1.5)
    clock.advance(0)
    assert clock.now_ms() == 2_500


def test_manual_clock_keeps_milliseconds() -> None:
    clock = ManualClock(start_ms=0)

    clock.advance(0.001)

    assert clock.now_ms() == 1


@pytest.mark.parametrize("seconds", [-0.001, -1.0, math.nan, math.inf, -math.inf])
def test_manual_clock_cannot_go_back_or_jump_to_no_time(seconds: float) -> None:
    clock = ManualClock(start_ms=1_000)
    mono = clock.monotonic()

    with pytest.raises(ValueError, match=r"cannot go back"):
        clock.advance(seconds)
    assert (clock.now_ms(), clock.monotonic()) == (1_000, mono)


def test_system_clock_follows_the_wall_and_never_goes_back() -> None:
    clock: Clock = SYSTEM_CLOCK
    before_ms = time.time_ns() // 1_000_000

    now_ms = clock.now_ms()
    first, second = clock.monotonic(), clock.monotonic()

    assert before_ms <= now_ms <= time.time_ns() // 1_000_000
    assert second >= first


def test_manual_clock_is_a_clock() -> None:
    clock: Clock = ManualClock()

    assert clock.now_ms() == 1_700_000_000_000
