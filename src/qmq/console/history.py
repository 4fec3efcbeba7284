"""The console's memory of the last hour: rates in and out per subject and each group's lag,
sampled every few seconds from what ``qmq top`` reads (``qmq.cli.top_commands``: the meta
server's cluster view and every server's ``/metrics``), for the charts of the subjects and
group pages.

Bounded: one sample every ``SAMPLE_INTERVAL_S`` for an hour, at most ``SERIES_MAX`` series
(the ones past it are counted, not kept). Sampling runs only while someone uses the console
(a page within the last hour), as the last person who opened a page: with an auth file the
meta server's own HTTP calls need an app, and the console has none of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from typing import Any, Final

import aiohttp

from qmq.cli.auth_commands import ACTING_FOR
from qmq.common.errors import QmqError

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S: Final = 5.0
HISTORY_S: Final = 3600.0
POINTS_MAX: Final = int(HISTORY_S / SAMPLE_INTERVAL_S)
# subjects plus groups charted; a cluster with more keeps the first ones seen
SERIES_MAX: Final = 2_000
# sampling stops this long after the last page was opened
IDLE_STOP_S: Final = HISTORY_S

Key = tuple[str, ...]  # ("in", subject), ("out", subject), ("lag", subject, group)


class RateHistory:
    """Samples on one time axis: ``times`` (epoch seconds) and, per series, one value a sample
    (None where the series had none)."""

    def __init__(self, points_max: int = POINTS_MAX, series_max: int = SERIES_MAX) -> None:
        self.points_max = points_max
        self.series_max = series_max
        self.times: deque[float] = deque(maxlen=points_max)
        self.series: dict[Key, deque[float | None]] = {}
        self.dropped_series = 0

    def add(self, at_s: float, values: dict[Key, float | None]) -> None:
        """One sample: ``values`` of the series seen now; the others get None."""
        self.times.append(at_s)
        for key in values:
            if key not in self.series:
                if len(self.series) >= self.series_max:
                    self.dropped_series += 1
                    continue
                # back-filled so every series lines up with ``times``
                self.series[key] = deque([None] * (len(self.times) - 1), maxlen=self.points_max)
        for key, line in self.series.items():
            line.append(values.get(key))

    def chart(self, keys: list[tuple[str, Key]]) -> dict[str, Any]:
        """``{"t": [epoch s...], "labels": [...], "series": [[value...]...]}`` of the series asked
        for (labelled), in uPlot's column order; a series never seen is all None."""
        empty = [None] * len(self.times)
        return {
            "t": [round(t, 3) for t in self.times],
            "labels": [label for label, _ in keys],
            "series": [list(self.series.get(key, empty)) for _, key in keys],
        }


def sample_values(doc: dict[str, Any]) -> dict[Key, float | None]:
    """The series of one ``qmq top`` view: rates in and out per subject, lag per group."""
    values: dict[Key, float | None] = {}
    for s in doc.get("subjects", []):
        values[("in", s["subject"])] = s.get("in_per_s")
        values[("out", s["subject"])] = s.get("out_per_s")
    for g in doc.get("groups", []):
        values[("lag", g["subject"], g["group"])] = float(g.get("lag", 0))
    return values


class Sampler:
    """Keeps ``history`` filled while the console is in use; ``touch()`` on every page."""

    def __init__(self, meta_server: Any, interval_s: float = SAMPLE_INTERVAL_S) -> None:
        self._meta_server = meta_server  # () -> the meta server's URL, known once it listens
        self.interval_s = interval_s
        self.history = RateHistory()
        self.latest: dict[str, Any] | None = None  # the last ``qmq top`` view
        self._acting: tuple[str, str] | None = None
        self._used_s = 0.0
        self._task: asyncio.Task[None] | None = None

    def touch(self) -> None:
        """A page was opened, as whoever ACTING_FOR names: sample (on) as that app."""
        self._acting = ACTING_FOR.get()
        self._used_s = time.monotonic()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def close(self) -> None:
        if self._task is not None:
            task, self._task = self._task, None
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _run(self) -> None:
        from qmq.cli.top_commands import take_snapshot, view

        timeout = aiohttp.ClientTimeout(total=max(3.0, self.interval_s))
        before = None
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while time.monotonic() - self._used_s < IDLE_STOP_S:
                started = time.monotonic()
                token = ACTING_FOR.set(self._acting)
                try:
                    snap = await take_snapshot(http, self._meta_server(), with_delay=False)
                except QmqError as exc:  # the meta server away a moment: the next sample may do
                    log.warning("console: cannot sample the cluster's rates: %s", exc)
                except Exception:  # one bad sample never stops the sampling
                    log.exception("console: a sample of the cluster's rates failed")
                else:
                    doc = view(snap, before)
                    if before is not None:
                        self.history.add(time.time(), sample_values(doc))
                    before, self.latest = snap, doc
                finally:
                    ACTING_FOR.reset(token)
                await asyncio.sleep(max(0.0, self.interval_s - (time.monotonic() - started)))
