"""The producer's send buffer: encoded messages waiting for a sender, bounded in messages and
bytes, grouped by the broker groups their subject is routed to.

A message counts against the bounds from ``append`` until ``release`` (after the broker
answered for it, or it failed), so messages in flight are bounded too. Entries are plain
tuples, ``(encoded, waiter, message_id, enqueued_at, epoch)``: the waiter is an
``asyncio.Future`` or a ``concurrent.futures.Future`` (the blocking SDK), resolved by the
sender; the epoch lets ``flush`` wait for exactly what was buffered before it was called.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Final, Protocol

from qmq.common.errors import BufferFullError

ENCODED: Final = 0
WAITER: Final = 1
MESSAGE_ID: Final = 2
ENQUEUED_AT: Final = 3
EPOCH: Final = 4
# True: the message may have been sent before (ProducerOptions.resends, for this message alone)
RESEND: Final = 5


class Waiter(Protocol):
    """What a buffered message's sender resolves: an asyncio or a concurrent future."""

    def done(self) -> bool: ...
    def set_result(self, result: None, /) -> None: ...
    def set_exception(self, exception: BaseException, /) -> None: ...


Entry = tuple[bytes, Waiter, str, float, int, bool]
RouteKey = tuple[str, ...]


class Accumulator:
    """Bounded FIFO queues of encoded messages, one per route (tuple of broker group names)."""

    def __init__(self, messages_max: int, bytes_max: int) -> None:
        self.messages_max = messages_max
        self.bytes_max = bytes_max
        self.count = 0  # messages appended and not yet released (queued, held or in flight)
        self.nbytes = 0
        self._queues: dict[RouteKey, deque[Entry]] = {}
        self._keys_of: dict[str, list[RouteKey]] = {}
        self._cursor: dict[str, int] = {}
        # Messages of subjects whose route is being looked up.
        self._held: dict[str, deque[Entry]] = {}
        # Flush bookkeeping: messages of the current epoch are counted in one int; an epoch
        # is sealed into _epoch_counts when a flush begins.
        self.epoch = 0
        self._open_epoch_count = 0
        self._epoch_counts: dict[int, int] = {}
        self._flush_waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._room = asyncio.Event()
        self._room.set()

    def has_room(self, nbytes: int, extra_messages: int = 0, extra_bytes: int = 0) -> bool:
        """Whether a message of ``nbytes`` fits, with ``extra_*`` more already promised."""
        return self.count + extra_messages < self.messages_max and self.nbytes + extra_bytes + nbytes <= self.bytes_max

    def full_error(self, nbytes: int, message_id: str | None = None) -> BufferFullError:
        if nbytes > self.bytes_max:
            return BufferFullError(
                f"the message of {nbytes} bytes is larger than buffer_bytes_max={self.bytes_max}; raise it",
                message_id,
            )
        return BufferFullError(
            f"the send buffer is full ({self.count} messages, {self.nbytes} bytes; buffer_messages_max="
            f"{self.messages_max}, buffer_bytes_max={self.bytes_max}): the brokers store messages slower "
            "than they are sent; await send() (it waits for room), slow down, or raise the limits",
            message_id,
        )

    def _admit(self, entry: Entry) -> None:
        n = len(entry[ENCODED])
        if not (self.count < self.messages_max and self.nbytes + n <= self.bytes_max):
            raise self.full_error(n, entry[MESSAGE_ID])
        self.count += 1
        self.nbytes += n
        self._open_epoch_count += 1
        if self.count >= self.messages_max:
            self._room.clear()

    def append(self, key: RouteKey, entry: Entry) -> bool:
        """Queue ``entry`` for the broker groups in ``key``; BufferFullError when there is no room.

        Returns True when the route's queue was empty: only then may a sender be idle.
        """
        self._admit(entry)
        q = self._queues.get(key)
        if q is None:
            q = self._new_queue(key)
        was_empty = not q
        q.append(entry)
        return was_empty

    def hold(self, subject: str, entry: Entry) -> None:
        """Keep ``entry`` aside until the route of ``subject`` is known (``route_held``)."""
        self._admit(entry)
        self._held.setdefault(subject, deque()).append(entry)

    def route_held(self, subject: str, pick: Callable[[Entry], RouteKey | None]) -> set[RouteKey]:
        """Queue what was held for ``subject``, each on the route ``pick`` gives it (held still,
        in order, when it gives None); return the routes that got messages."""
        held = self._held.pop(subject, None)
        keys: set[RouteKey] = set()
        for entry in held or ():
            key = pick(entry)
            if key is None:
                self._held.setdefault(subject, deque()).append(entry)
                continue
            q = self._queues.get(key)
            if q is None:
                q = self._new_queue(key)
            q.append(entry)
            keys.add(key)
        return keys

    def move(self, key: RouteKey, pick: Callable[[Entry], RouteKey]) -> set[RouteKey]:
        """Queue what is queued on ``key`` on the route ``pick`` gives each message instead (in
        order); return the routes that got messages."""
        q = self._queues.get(key)
        keys: set[RouteKey] = set()
        if not q:
            return keys
        entries = list(q)
        q.clear()  # before: ``pick`` may give ``key`` itself back
        for entry in entries:
            to = pick(entry)
            dest = self._queues.get(to)
            if dest is None:
                dest = self._new_queue(to)
            dest.append(entry)
            keys.add(to)
        return keys

    def holds(self, subject: str) -> bool:
        """Whether messages of ``subject`` are held."""
        return subject in self._held

    def held_subjects(self) -> list[str]:
        return list(self._held)

    def _new_queue(self, key: RouteKey) -> deque[Entry]:
        q: deque[Entry] = deque()
        self._queues[key] = q
        for group in key:
            self._keys_of.setdefault(group, []).append(key)
        return q

    def oldest_enqueued_at(self, group: str) -> float | None:
        """When the oldest message queued for ``group`` entered, or None when none is queued."""
        heads = [q[0][ENQUEUED_AT] for k in self._keys_of.get(group, ()) if (q := self._queues[k])]
        return min(heads) if heads else None

    def queued_for(self, group: str) -> bool:
        return any(self._queues[k] for k in self._keys_of.get(group, ()))

    def drain(self, group: str, messages_max: int, bytes_max: int) -> tuple[RouteKey, list[Entry]] | None:
        """Take the next batch ``group`` may send: one route's oldest messages, within the bounds.

        A single message larger than ``bytes_max`` forms a batch of its own.
        """
        keys = self._keys_of.get(group)
        if not keys:
            return None
        start = self._cursor.get(group, 0)
        n = len(keys)
        for i in range(n):
            key = keys[(start + i) % n]
            q = self._queues[key]
            if not q:
                continue
            # Routes take turns, so a busy subject cannot starve another route's.
            self._cursor[group] = (start + i + 1) % n
            batch = [q.popleft()]
            size = len(batch[0][ENCODED])
            popleft = q.popleft
            append = batch.append
            while q and len(batch) < messages_max:
                m = len(q[0][ENCODED])
                if size + m > bytes_max:
                    break
                size += m
                append(popleft())
            return key, batch
        return None

    def expire(self, enqueued_before: float) -> list[tuple[RouteKey | str, Entry]]:
        """Take out the queued or held messages that entered before ``enqueued_before``.

        Returned with their route (or, for held ones, their subject); the caller fails and
        releases them.
        """
        out: list[tuple[RouteKey | str, Entry]] = []
        places: list[tuple[RouteKey | str, deque[Entry]]] = [*self._queues.items(), *self._held.items()]
        for where, q in places:
            while q and q[0][ENQUEUED_AT] < enqueued_before:
                out.append((where, q.popleft()))
        return out

    def take_all(self) -> list[Entry]:
        """Every queued and held message (on close)."""
        out: list[Entry] = []
        for q in [*self._queues.values(), *self._held.values()]:
            out.extend(q)
            q.clear()
        self._held.clear()
        return out

    def release(self, entries: list[Entry]) -> None:
        """The broker answered for ``entries`` (or they failed): free their room."""
        counts = self._epoch_counts
        current = self.epoch
        nbytes = 0
        for e in entries:
            nbytes += len(e[ENCODED])
            epoch = e[EPOCH]
            if epoch == current:
                self._open_epoch_count -= 1
                continue
            left = counts[epoch] - 1
            if left:
                counts[epoch] = left
            else:
                del counts[epoch]
        self.count -= len(entries)
        self.nbytes -= nbytes
        if not self._room.is_set() and self.has_room(1):
            self._room.set()
        if self._flush_waiters:
            self._wake_flushed()

    async def wait_for_room(self, nbytes: int, timeout_s: float) -> bool:
        """Wait until a message of ``nbytes`` fits, at most ``timeout_s``; False if it never did."""
        if nbytes > self.bytes_max:
            return False
        try:
            async with asyncio.timeout(timeout_s):
                while not self.has_room(nbytes):
                    self._room.clear()
                    await self._room.wait()
        except TimeoutError:
            return False
        return True

    def begin_flush(self) -> asyncio.Future[None]:
        """A future that resolves once every message appended before this call is released."""
        epoch = self.epoch
        if self._open_epoch_count:
            self._epoch_counts[epoch] = self._open_epoch_count
        self._open_epoch_count = 0
        self.epoch += 1
        fut = asyncio.get_running_loop().create_future()
        self._flush_waiters.append((epoch, fut))
        self._wake_flushed()
        return fut

    def _wake_flushed(self) -> None:
        oldest = min(self._epoch_counts, default=self.epoch)
        waiting = []
        for epoch, fut in self._flush_waiters:
            if epoch < oldest:
                if not fut.done():
                    fut.set_result(None)
            elif not fut.done():
                waiting.append((epoch, fut))
        self._flush_waiters = waiting
