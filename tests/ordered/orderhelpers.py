"""Helpers of the ordered-message tests: sending keys × messages in order, and checking what
handlers saw against the rule "per key, never skip or reorder; a repeat may go back"."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from qmq.aio import Producer


async def send_keys(
    meta_server: str, subject: str, keys: int, per_key: int, prefix: str = "k", first: int = 0
) -> None:
    """Send messages ``first`` to ``per_key`` - 1 (bodies "0", "1", ...) of each of ``keys`` keys,
    keys interleaved (``order="strict"``, the default for ordered sends)."""
    async with Producer(app_code="t", meta_server=meta_server, send_timeout_ms=60_000) as producer:
        for n in range(first, per_key):
            futures = []
            for i in range(keys):
                m = producer.generate_message(subject)
                m.set_order_key(f"{prefix}{i}")
                m.body = str(n).encode()
                futures.append(producer.send_nowait(m))
                if len(futures) >= 5000:
                    await asyncio.gather(*futures)
                    futures = []
            await asyncio.gather(*futures)


def order_problems(handled: Iterable[tuple[str, int]], keys: Iterable[str], per_key: int) -> list[str]:
    """Per key, each message handled must be at most one past the highest handled before it (no
    skip, no reorder; going back is a redelivery's repeat), and every one must be handled."""
    top: dict[str, int] = dict.fromkeys(keys, -1)
    problems: list[str] = []
    for key, n in handled:
        if n > top[key] + 1:
            problems.append(f"key {key}: message {n} handled when the highest before it was {top[key]}")
        top[key] = max(top[key], n)
    problems += [f"key {k}: only up to {t} of {per_key - 1} handled" for k, t in top.items() if t != per_key - 1]
    return problems
