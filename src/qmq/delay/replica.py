"""What a delay master sends its slaves, and what a delay slave does with it (docs/cluster.md,
"Delay groups").

A slave's write-ahead log is a byte-for-byte copy of its master's, at the same offsets and in
segments with the same bases (``qmq.store.replica``, as a broker slave's message log). The
slave replays what it copies into its own schedule logs exactly as recovery would
(``recovery.replay_wal``), cancel records included: the records come in the master's order,
so every message gets the entry number it has on the master.

What the master handed over is in its buckets' dispatch logs, which the write-ahead log does
not hold. So once a slave has the whole write-ahead log, an answer also carries the new tails
of the master's dispatch logs: per bucket, the entries past what this slave has copied of it
(the request says how much, by bucket). The slave appends those of them its own dispatch
log does not hold yet (its replay of a cancel record wrote some already), so after a promotion
it hands over only what its master had not handed over, or had and the slave had not heard of
yet: a repeat the broker's duplicate window drops, since the hand-over carries the message id.

Each master process answers with a token of its own; a slave that meets a new token asks for
the dispatch logs from their start (a restarted master's recovery may have rewritten them).
A slave asking from before the start of the master's write-ahead log (it was down while the
master deleted what it had not copied) is answered ``behind`` and copies the master's schedule
anew from its last checkpoint (resync.py) before it copies the log again.

Memory: one bit per entry of each bucket whose dispatch log the slave is copying.

Synchronous; runs on the server's event loop.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from qmq.delay.bucket import DISPATCH_DTYPE, DISPATCH_ENTRY_BYTES
from qmq.delay.recovery import replay_wal
from qmq.delay.resync import Resync, behind_answer, read_part
from qmq.delay.store import DelayStore
from qmq.protocol.frame import Frame
from qmq.serving.replication import CHUNK_BYTES_MAX
from qmq.store.message_log import ScanResult
from qmq.store.replica import Chunk, ReplicaError, append_records, read_records

log = logging.getLogger(__name__)

# Buckets whose dispatch-log tails one answer carries, at most (the rest come with the next).
_TAILS_MAX = 64


def master_token() -> int:
    """A number this master process answers with (its pid and start time, folded)."""
    return (os.getpid() << 20) ^ (int.from_bytes(os.urandom(4), "little"))


def read_for_slave(store: DelayStore, token: int, header: dict[str, Any]) -> tuple[dict[str, Any], list[bytes], bool]:
    """The answer to a slave's REPLICATE: write-ahead log records from ``from`` and, once those
    reach the end, the dispatch-log tails the slave lacks (``dispatch``: {bucket start: bytes})."""
    budget = min(int(header.get("max_bytes", CHUNK_BYTES_MAX)), CHUNK_BYTES_MAX)
    snapshot = header.get("snapshot")
    if isinstance(snapshot, dict):
        fields, data = read_part(store.dir, store.schedule.directory, snapshot, budget)
        return {**behind_answer(token, store.wal.start), "behind": None, "snapshot": fields}, [data], True
    if int(header["from"]) < store.wal.start:
        return behind_answer(token, store.wal.start), [], True
    chunk = read_records(store.wal.segments, int(header["from"]), budget)
    parts = [chunk.data] if chunk.data else []
    tails: list[list[int]] = []
    if chunk.offset + len(chunk.data) >= store.wal.end:
        known = header.get("dispatch")
        if header.get("token") != token or not isinstance(known, dict):
            known = {}
        left = budget - len(chunk.data)
        buckets = store.buckets
        for start in sorted(store.dispatch_starts):
            b = buckets.get(start)
            if b is None:
                continue
            have = b.dispatched * DISPATCH_ENTRY_BYTES
            copied = known.get(str(b.start_ms), 0)
            if not isinstance(copied, int) or copied > have:
                copied = 0  # not this master's view of the bucket: send it whole
            if have <= copied:
                continue
            data = b.read_dispatched()[copied // DISPATCH_ENTRY_BYTES :].tobytes()
            data = data[: max(DISPATCH_ENTRY_BYTES, left - left % DISPATCH_ENTRY_BYTES)]
            if not data:
                continue
            tails.append([b.start_ms, copied, len(data)])
            parts.append(data)
            left -= len(data)
            if left <= 0 or len(tails) >= _TAILS_MAX:
                break
    fields = {
        "offset": chunk.offset,
        "segment_base": chunk.segment_base,
        "count": len(chunk.data),
        "token": token,
        "dispatch": tails,
    }
    return fields, parts, bool(parts)


class SlaveCopy:
    """A delay slave's side: where its copy ends (``ask``) and appending an answer (``take``).

    ``install`` swaps a copy of the master's schedule in once it is whole (the server's, which
    holds off its checkpoints meanwhile); ``take`` returns what it must await then."""

    def __init__(self, store: DelayStore, install: Callable[[Resync], Awaitable[None]] | None = None) -> None:
        self.store = store
        self.install = install
        self.resync: Resync | None = None  # copying the master's schedule anew (resync.py)
        self.token: int | None = None
        self.copied: dict[int, int] = {}  # bucket start -> bytes of the master's dispatch log copied
        self._done: dict[int, npt.NDArray[np.bool_]] = {}  # bucket start -> entries its dispatch log holds
        self.replayed = 0  # write-ahead log records replayed since this copy began

    def ask(self) -> dict[str, Any]:
        buckets = self.store.buckets
        for start in [s for s in self.copied if s not in buckets]:
            del self.copied[start]  # finished and deleted here too
            self._done.pop(start, None)
        asked: dict[str, Any] = {
            "from": self.store.wal.end,
            "action_from": 0,
            "token": self.token,
            "dispatch": {str(s): n for s, n in self.copied.items()},
        }
        if self.resync is not None:
            asked["snapshot"] = self.resync.ask()
            asked["dispatch"] = {}
        return asked

    @property
    def resyncing(self) -> bool:
        """Whether this copy is being made anew: it must not be promoted meanwhile."""
        return self.resync is not None

    def take(self, frame: Frame) -> Awaitable[None] | None:
        h = frame.header
        if isinstance(h.get("behind"), int) or isinstance(h.get("snapshot"), dict):
            return self._take_anew(h, bytes(frame.body))
        body = memoryview(bytes(frame.body))
        store = self.store
        token = h.get("token")
        if token != self.token:
            self.token = token if isinstance(token, int) else None
            self.copied.clear()
        n = int(h["count"])
        if n:
            offset = int(h["offset"])
            append_records(store.wal.segments, Chunk(offset, int(h["segment_base"]), bytes(body[:n])))
            result: list[ScanResult] = []
            replayed, cancels, next_sequence = replay_wal(store.schedule, store.wal, offset, result)
            if result and result[-1].torn_bytes:
                raise ReplicaError(f"write-ahead log records copied at offset {offset} do not replay")
            store.wal_messages = max(store.wal_messages, next_sequence)
            self.replayed += replayed
            if cancels:
                self._done.clear()  # the cancels wrote dispatch entries: read them again when needed
                store.find_dispatch_starts()
        pos = n
        tails = h.get("dispatch") or []
        if tails:
            store.flush_deferred()  # entries of far buckets must be in them before they are marked
        for start, copied, size in tails:
            entries = np.frombuffer(body[pos : pos + size], dtype=DISPATCH_DTYPE)
            pos += size
            if self.copied.get(start, 0) != copied:
                continue  # not where this copy of it ends (a stale answer): asked for again
            self._mark(int(start), entries)
            self.copied[start] = copied + size

        return None

    def _take_anew(self, h: dict[str, Any], body: bytes) -> Awaitable[None] | None:
        if isinstance(h.get("behind"), int):
            if self.resync is None:
                log.warning(
                    "this delay slave's copy ends at write-ahead log offset %d and its master's log now begins at %d "
                    "(it deleted what this slave had not copied): copying the master's schedule anew",
                    self.store.wal.end,
                    h["behind"],
                )
                self.resync = Resync(self.store.dir, int(h["behind"]))
            return None
        resync = self.resync
        if resync is None:
            return None  # a stale answer
        resync.take(h["snapshot"], body)
        if not resync.done:
            return None
        return self._install(resync)

    async def _install(self, resync: Resync) -> None:
        if self.install is None:
            raise ReplicaError("this copy cannot swap in a copy of its master's schedule")
        await self.install(resync)
        self.resync = None
        self.token = None  # the dispatch logs come whole with the next answers
        self.copied.clear()
        self._done.clear()

    def _mark(self, start: int, entries: npt.NDArray[np.uint32]) -> None:
        b = self.store.buckets.get(start)
        if b is None:
            return
        done = self._done.get(start)
        if done is None:
            done = np.zeros(b.count, dtype=bool)
            held = b.read_dispatched()
            done[held[held < b.count]] = True
        if len(done) < b.count:
            done = np.concatenate([done, np.zeros(b.count - len(done), dtype=bool)])
        self._done[start] = done
        entries = entries[entries < b.count]
        new = np.unique(entries[~done[entries]])
        if len(new):
            self.store.dispatched(start, new.astype(DISPATCH_DTYPE).tobytes())
            done[new] = True
