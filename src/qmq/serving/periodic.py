"""A server's periodic jobs (checkpoints, retention, timeouts): each runs on its own timer, and
a run that fails is logged and retried at the next period, never ending the timer."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

log = logging.getLogger(__name__)

Job = Callable[[], Awaitable[None]]


class Periodic:
    def __init__(self) -> None:
        self._tasks: list[asyncio.Task[None]] = []

    def every(self, interval_ms: int, job: Job) -> None:
        """Run ``job`` every ``interval_ms`` (the first run one period from now) until ``stop``."""
        self._tasks.append(asyncio.get_running_loop().create_task(_every(interval_ms, job)))

    async def stop(self) -> None:
        """Cancel every timer and wait until each has ended (a run in progress is cancelled)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)


async def _every(interval_ms: int, job: Job) -> None:
    while True:
        await asyncio.sleep(interval_ms / 1000)  # the job's period
        try:
            await job()
        except Exception:  # a failed checkpoint or retention run is retried next time
            log.exception("periodic %s failed", getattr(job, "__name__", job))
