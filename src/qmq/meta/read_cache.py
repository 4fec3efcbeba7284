"""When the meta server reads its store again: at most once a cache period, serving what memory
holds through a database outage (clients keep finding brokers), the failures logged the first
time and every hundredth."""

from __future__ import annotations

import logging
from collections.abc import Callable

from qmq.common.clock import Clock
from qmq.meta.store import MetaStoreError

log = logging.getLogger(__name__)


class ReadCache:
    """``fresh()`` calls ``reload`` once ``cache_s`` passed since the last read (``loaded()``)."""

    def __init__(self, clock: Clock, cache_s: float, reload: Callable[[], None], what: str) -> None:
        self._clock = clock
        self.cache_s = cache_s
        self._reload = reload
        self._what = what  # "the servers and groups", for the log line
        self._loaded_at = -1e18
        self._failures = 0

    def loaded(self) -> None:
        """The rows were just read."""
        self._loaded_at = self._clock.monotonic()

    def fresh(self) -> None:
        now = self._clock.monotonic()
        if now - self._loaded_at < self.cache_s:
            return
        try:
            self._reload()
        except MetaStoreError as exc:
            # tried again after another cache period, not on every request
            self._loaded_at = now
            self._failures += 1
            if self._failures == 1 or self._failures % 100 == 0:
                log.warning("serving %s read before: %s", self._what, exc)
        else:
            self._failures = 0
