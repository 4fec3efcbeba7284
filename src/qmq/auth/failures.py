"""Failed handshakes per client address, and how long to hold the next handshake from it.

After ``FREE_FAILURES`` failures within ``WINDOW_S`` from one address, each further
handshake from it waits a little longer (``STEP_S`` more per failure, at most ``DELAY_MAX_S``)
before it is answered. It is never refused: a client with the right secret still gets in, a
guesser gets few guesses a second. The table of addresses is bounded; past ``ADDRESSES_MAX``
the address seen least recently is forgotten.
"""

from __future__ import annotations

from collections import OrderedDict, deque

WINDOW_S = 60.0
FREE_FAILURES = 10
STEP_S = 0.1
DELAY_MAX_S = 1.0
ADDRESSES_MAX = 10_000


class FailedHandshakes:
    def __init__(self, addresses_max: int = ADDRESSES_MAX) -> None:
        self._addresses_max = addresses_max
        # address → times of its failures within the window (at most FREE_FAILURES + the steps to the cap)
        self._failures: OrderedDict[str, deque[float]] = OrderedDict()
        self._kept = FREE_FAILURES + round(DELAY_MAX_S / STEP_S)

    def _recent(self, address: str, now_s: float) -> deque[float] | None:
        times = self._failures.get(address)
        if times is None:
            return None
        while times and times[0] <= now_s - WINDOW_S:
            times.popleft()
        if not times:
            del self._failures[address]
            return None
        return times

    def failed(self, address: str, now_s: float) -> None:
        times = self._recent(address, now_s)
        if times is None:
            times = self._failures[address] = deque(maxlen=self._kept)
            if len(self._failures) > self._addresses_max:
                self._failures.popitem(last=False)
        else:
            self._failures.move_to_end(address)
        times.append(now_s)

    def delay_s(self, address: str, now_s: float) -> float:
        """How long to hold a handshake from ``address`` before answering it (0 for most)."""
        times = self._recent(address, now_s)
        if times is None or len(times) < FREE_FAILURES:
            return 0.0
        return min(DELAY_MAX_S, STEP_S * (len(times) - FREE_FAILURES + 1))

    def __len__(self) -> int:
        return len(self._failures)


def address_of(peer: str) -> str:
    """The host of a ``host:port`` peer (a client's port changes with each connection)."""
    host, sep, _port = peer.rpartition(":")
    return host if sep else peer
