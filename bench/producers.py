"""Producer loops, the same for every system: bounded windows of acknowledged batches.

Every loop is bounded by its message count and by a deadline (monotonic seconds)."""

from __future__ import annotations

import asyncio
import random
import time
from collections import deque
from collections.abc import Awaitable, Sequence
from typing import Any

from bench.adapters.base import Adapter
from bench.payload import make_body
from bench.settings import PAYLOAD_BYTES

DELAY_SCHEDULE_SEED = 42


class Window:
    """Batches sent and not yet acknowledged, oldest first, at most `limit` messages."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self._batches: deque[tuple[Awaitable[Any], int]] = deque()
        self.in_flight = 0

    def add(self, ack: Awaitable[Any], messages: int) -> None:
        self._batches.append((ack, messages))
        self.in_flight += messages

    async def make_room(self, deadline: float) -> None:
        """Collect finished acks; wait for the oldest while the window is full."""
        while self._batches:
            ack, messages = self._batches[0]
            finished = isinstance(ack, asyncio.Future) and ack.done()
            if not finished and self.in_flight < self.limit:
                return
            self._batches.popleft()
            await asyncio.wait_for(ack, max(0.1, deadline - time.monotonic()))
            self.in_flight -= messages

    async def drain(self, deadline: float) -> None:
        while self._batches:
            ack, messages = self._batches.popleft()
            await asyncio.wait_for(ack, max(0.1, deadline - time.monotonic()))
            self.in_flight -= messages


def _check_deadline(deadline: float, what: str, sent: int) -> None:
    if time.monotonic() > deadline:
        raise TimeoutError(f"{what}: deadline passed after {sent} messages")


async def produce_bulk(
    adapter: Adapter, subjects: Sequence[str], n: int, batch: int, window_limit: int, deadline: float,
    body_bytes: int = PAYLOAD_BYTES, seq_base: int = 0,
) -> dict[str, Any]:
    """W1/W2/W6/W7/W9/W10/W11: n messages of body_bytes as fast as the acks allow; batch k goes to
    subjects[k % len]; sequence numbers from seq_base."""
    window = Window(window_limit)
    started = time.perf_counter()
    cpu_started = time.process_time()
    sent = 0
    batch_index = 0
    while sent < n:
        _check_deadline(deadline, "bulk producer", sent)
        count = min(batch, n - sent)
        now_ns = time.monotonic_ns()
        bodies = [make_body(seq_base + sent + i, now_ns, now_ns, body_bytes) for i in range(count)]
        ack = await adapter.send_batch(subjects[batch_index % len(subjects)], bodies)
        window.add(ack, count)
        sent += count
        batch_index += 1
        await window.make_room(deadline)
    await window.drain(deadline)
    seconds = time.perf_counter() - started
    return {
        "messages": n,
        "seconds": round(seconds, 3),
        # the producer process's own CPU (user + system): a cost per message the machine's load moves less
        "client_cpu_s": round(time.process_time() - cpu_started, 3),
        "msgs_per_s": round(n / seconds, 1),
        "body_bytes": body_bytes,
        "MB_per_s": round(n * body_bytes / seconds / 1e6, 2),
    }


async def produce_paced(
    adapter: Adapter, subject: str, rate_per_s: float, duration_s: float, batch: int, window_limit: int,
    deadline: float,
) -> dict[str, Any]:
    """W3: a fixed rate; each message carries its send time and its intended send time."""
    total = int(rate_per_s * duration_s)
    window = Window(window_limit)
    start = time.monotonic() + 0.02
    start_ns = int(start * 1e9)
    sent = 0
    max_lag_s = 0.0
    while sent < total:
        now = time.monotonic()
        _check_deadline(deadline, "paced producer", sent)
        due = min(total, int((now - start) * rate_per_s) + 1) if now >= start else 0
        if due > sent:
            count = min(due - sent, batch)
            now_ns = time.monotonic_ns()
            bodies = [
                make_body(sent + i, now_ns, start_ns + int((sent + i) * 1e9 / rate_per_s)) for i in range(count)
            ]
            max_lag_s = max(max_lag_s, now - (start + sent / rate_per_s))
            window.add(await adapter.send_batch(subject, bodies), count)
            sent += count
            await window.make_room(deadline)
        else:
            await window.make_room(deadline)
            next_due = start + sent / rate_per_s
            await asyncio.sleep(max(0.0, min(0.001, next_due - time.monotonic())))
    ended = time.monotonic()
    await window.drain(deadline)
    return {
        "messages": total,
        "target_rate_per_s": rate_per_s,
        "seconds": round(ended - start, 3),
        "achieved_rate_per_s": round(total / (ended - start), 1),
        "max_producer_lag_ms": round(max_lag_s * 1000, 2),
    }


WARM_UP_DELAY_S = 3600.0
WARM_UP_BATCHES = 5
WARM_UP_SEQ_BASE = 1 << 40


async def warm_up_delayed(adapter: Adapter, subject: str, batch: int, deadline: float) -> None:
    """A few batches of delayed sends due an hour from now (past the end of the cell, never
    received), before the cell starts; their sequence numbers are past any the cell uses."""
    if await adapter.delay_unsupported() is not None:
        return
    due_s = time.time() + WARM_UP_DELAY_S
    for k in range(WARM_UP_BATCHES):
        _check_deadline(deadline, "delayed producer's warm-up", k * batch)
        items = [(make_body(WARM_UP_SEQ_BASE + k * batch + i, int(due_s * 1e9), 0), due_s) for i in range(batch)]
        await (await adapter.send_delayed_batch(subject, items))


async def produce_delayed(
    adapter: Adapter, subject: str, n: int, first_due_epoch_s: float | None, spread_s: float, batch: int,
    window_limit: int, deadline: float,
) -> dict[str, Any]:
    """W4/W5: n messages due uniformly over [first_due, first_due + spread), sent in random
    order. A due time already past when its message is sent is moved to the send time
    and counted in `clamped_to_send_time`."""
    reason = await adapter.delay_unsupported()
    if reason is not None:
        return {"skipped": reason}
    rnd = random.Random(DELAY_SCHEDULE_SEED)
    offsets_s = [rnd.random() * spread_s for _ in range(n)]
    order = list(range(n))
    rnd.shuffle(order)
    first_due = time.time() if first_due_epoch_s is None else first_due_epoch_s
    window = Window(window_limit)
    clamped = 0
    sent = 0
    started = time.perf_counter()
    while sent < n:
        _check_deadline(deadline, "delayed producer", sent)
        now = time.time()
        items: list[tuple[bytes, float]] = []
        for seq in order[sent : sent + batch]:
            due_s = first_due + offsets_s[seq]
            late = due_s < now
            if late:
                due_s = now
                clamped += 1
            # the body's second stamp marks a message due before it was sent (consumers report those apart)
            items.append((make_body(seq, int(due_s * 1e9), int(late)), due_s))
        window.add(await adapter.send_delayed_batch(subject, items), len(items))
        sent += len(items)
        await window.make_room(deadline)
    await window.drain(deadline)
    seconds = time.perf_counter() - started
    return {
        "messages": n,
        "first_due_epoch_s": first_due,
        "spread_s": spread_s,
        "schedule_seconds": round(seconds, 3),
        "schedule_msgs_per_s": round(n / seconds, 1),
        "clamped_to_send_time": clamped,
    }
