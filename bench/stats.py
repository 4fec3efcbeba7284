"""Percentiles and latency distributions as the reports print them."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any


def percentile(sorted_values: Sequence[int], q: float) -> int | None:
    """Nearest-rank percentile of an already sorted sequence (q in 0..1)."""
    if not sorted_values:
        return None
    rank = math.ceil(q * len(sorted_values)) - 1
    return sorted_values[max(0, min(len(sorted_values) - 1, rank))]


def distribution_ms(values_ns: Iterable[int]) -> dict[str, Any]:
    """n, min, p50, p90, p99, p99.9, max and mean of nanosecond samples, in milliseconds."""
    ordered = sorted(values_ns)
    if not ordered:
        return {"n": 0}

    def ms(value_ns: int | None) -> float | None:
        return None if value_ns is None else round(value_ns / 1e6, 3)

    return {
        "n": len(ordered),
        "min": ms(ordered[0]),
        "p50": ms(percentile(ordered, 0.50)),
        "p90": ms(percentile(ordered, 0.90)),
        "p99": ms(percentile(ordered, 0.99)),
        "p999": ms(percentile(ordered, 0.999)),
        "max": ms(ordered[-1]),
        "mean": ms(round(sum(ordered) / len(ordered))),
    }


def histogram_delta(before: dict[str, int] | None, after: dict[str, int] | None) -> dict[str, int] | None:
    """What a server's cumulative histogram (bound → count) counted between two scrapes."""
    if before is None or after is None:
        return None
    return {bound: count - before.get(bound, 0) for bound, count in after.items()}
