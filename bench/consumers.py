"""The consumer loop, the same for every system, in four modes:

- `drain`: receive a batch, ack the batch (W2, W6 CPU-bound, W7);
- `latency`: as drain, timing each message from its send stamps (W3);
- `delayed`: as drain, timing each message against its due time (W4, W5);
- `handled`: one message at a time through a handler that sleeps (simulated I/O),
  then ack that message (W6 elasticity).

It stops when the tally (shared by every member of the cell) has seen every expected
message, or at the deadline.

A consumer of `groups` consumer groups of one subject (W9's fan-out) gets every message once
per group: the tally counts (group, seq) pairs, `expected` = messages × groups, and the result
says how far the slowest group trailed (`fanout`)."""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Sequence
from typing import Any

from bench.adapters.base import Adapter
from bench.payload import read_header
from bench.stats import distribution_ms
from bench.tally import Tally

RECV_TIMEOUT_S = 0.5
MODES = ("drain", "latency", "delayed", "handled")


async def consume(
    adapter: Adapter,
    tally: Tally,
    mode: str,
    recv_max: int,
    deadline: float,
    handler_sleep_s: float = 0.0,
    groups: int = 1,
) -> dict[str, Any]:
    if mode not in MODES:
        raise ValueError(f"consumer mode {mode!r}: expected one of {MODES}")
    fanout = FanOut(groups, tally.expected // groups) if groups > 1 else None
    # samples in arrays, not lists: the collector never walks them (a list of a million ints
    # is walked on every full pass, and stalls this process as it grows)
    latencies_ns = array("q")
    from_schedule_ns = array("q")
    due_ns = array("q")
    clamped_ns = array("q")  # lateness of messages due before they were sent
    batches = 0
    started_ns = time.monotonic_ns()
    last_receipt_epoch_ns = 0
    timed_out = False
    while not tally.done():
        if time.monotonic() > deadline:
            timed_out = True
            break
        batch = await adapter.recv_batch(recv_max, RECV_TIMEOUT_S)
        if not batch:
            continue
        batches += 1
        now_ns = time.monotonic_ns()
        if mode == "handled":
            for body, token in batch:
                await asyncio.sleep(handler_sleep_s)
                seq, _a, _b = read_header(body)
                tally.record(seq, time.monotonic_ns())
                await adapter.ack_one(token)
                tally.publish()
            continue
        epoch_ns = time.time_ns()
        last_receipt_epoch_ns = epoch_ns
        for body, token in batch:
            seq, stamp_a, stamp_b = read_header(body)
            if fanout is not None:
                group = adapter.group_of(token)
                if not tally.record(fanout.key(group, seq), now_ns):
                    continue
                fanout.delivered(group, now_ns, now_ns - stamp_a if mode == "latency" else None)
            elif not tally.record(seq, now_ns):
                continue
            if mode == "latency":
                latencies_ns.append(now_ns - stamp_a)
                from_schedule_ns.append(now_ns - stamp_b)
                due_ns.append(stamp_a)  # here: when it was sent
            elif mode == "delayed":
                latencies_ns.append(epoch_ns - stamp_a)
                due_ns.append(stamp_a)
                if stamp_b:
                    clamped_ns.append(epoch_ns - stamp_a)
        await adapter.ack_batch([token for _body, token in batch])
        tally.publish()
    tally.publish()
    result: dict[str, Any] = {
        "expected": tally.expected,
        "received_unique": tally.unique,
        "duplicates": tally.duplicates,
        "batches": batches,
        "timed_out": timed_out,
        "started_ns": started_ns,
        "first_ns": tally.first_ns,
        "last_ns": tally.last_ns,
    }
    if tally.members == 1:
        result["missing"] = tally.expected - tally.unique
    if tally.first_ns:
        seconds = (tally.last_ns - started_ns) / 1e9
        result["seconds"] = round(seconds, 3)
        result["msgs_per_s"] = round(tally.unique / seconds, 1) if seconds > 0 else None
        result["seconds_to_first_msg"] = round((tally.first_ns - started_ns) / 1e9, 3)
    if fanout is not None:
        result["fanout"] = fanout.summary()
    if mode == "latency":
        result["latency_ms"] = distribution_ms(latencies_ns)
        result["latency_from_schedule_ms"] = distribution_ms(from_schedule_ns)
        result["latency_by_send_second"] = by_second(due_ns, latencies_ns)
    elif mode == "delayed":
        result["lateness_ms"] = distribution_ms(latencies_ns)
        result["early_count"] = sum(1 for x in latencies_ns if x < 0)
        result["lateness_by_due_second"] = by_second(due_ns, latencies_ns)
        result["lateness_due_before_sent_ms"] = distribution_ms(clamped_ns)
        result["last_receipt_epoch_ns"] = last_receipt_epoch_ns
    return result


def by_bucket(due_ns: Sequence[int], lateness_ns: Sequence[int], bucket_ms: int) -> list[tuple[int, dict[str, Any]]]:
    """Lateness (or latency) per ``bucket_ms`` of due (or send) time from the first one, as
    (bucket index, distribution): where in the window the tail comes from."""
    if not due_ns:
        return []
    first = min(due_ns)
    bucket_ns = bucket_ms * 1_000_000
    buckets: dict[int, list[int]] = {}
    for due, late in zip(due_ns, lateness_ns, strict=True):
        buckets.setdefault((due - first) // bucket_ns, []).append(late)
    return [(k, distribution_ms(values)) for k, values in sorted(buckets.items())]


def by_second(due_ns: Sequence[int], lateness_ns: Sequence[int]) -> list[dict[str, Any]]:
    """by_bucket per second, each row with its ``second``."""
    return [{"second": sec, **dist} for sec, dist in by_bucket(due_ns, lateness_ns, 1_000)]


class FanOut:
    """Deliveries per consumer group of a fan-out: each group reads every one of `per_group`
    messages. How far the slowest group trailed: its count when the first group had them all,
    the time from the first group's last message to the last group's, and (live) each group's
    latency p99."""

    def __init__(self, groups: int, per_group: int) -> None:
        self.groups = groups
        self.per_group = per_group
        self.counts = [0] * groups
        self.done_ns = [0] * groups
        self.slowest_when_first_done: int | None = None
        self.latencies_ns = [array("q") for _ in range(groups)]

    def key(self, group: int, seq: int) -> int:
        """The tally's index of (group, seq); out of range (counted a duplicate) for a bad one."""
        if not 0 <= group < self.groups or seq >= self.per_group:
            return self.groups * self.per_group
        return group * self.per_group + seq

    def delivered(self, group: int, now_ns: int, latency_ns: int | None) -> None:
        self.counts[group] += 1
        if latency_ns is not None:
            self.latencies_ns[group].append(latency_ns)
        if self.counts[group] == self.per_group:
            self.done_ns[group] = now_ns
            if self.slowest_when_first_done is None:
                self.slowest_when_first_done = min(self.counts)

    def summary(self) -> dict[str, Any]:
        done = [ns for ns in self.done_ns if ns]
        p99s = [distribution_ms(values).get("p99") for values in self.latencies_ns if values]
        return {
            "groups": self.groups,
            "per_group": self.per_group,
            "groups_complete": len(done),
            "slowest_group_received": min(self.counts),
            "slowest_group_behind_when_first_done": (
                None if self.slowest_when_first_done is None else self.per_group - self.slowest_when_first_done),
            "last_group_done_after_first_s": round((max(done) - min(done)) / 1e9, 3) if len(done) > 1 else None,
            "slowest_group_latency_p99_ms": max((p for p in p99s if p is not None), default=None),
        }
