"""Group commit: writes wait for one fdatasync that covers many of them.

Under the ``sync`` policy a write is answered only when an fsync that started after it has
returned. While one fsync runs on the worker thread, every write made meanwhile waits for the
next one, so many producers share each fsync. Under ``periodic`` a write is answered once
written and a timer fsyncs every ``flush_interval_ms``.

The role says what one flush covers (``begin``: fds and the offset they reach, on the loop)
and what becomes true once it has (``complete``: e.g. messages made visible to consumers).
Each waiting write's reply runs through ``call_reply``: one that fails is logged and the
others are answered; the flush task goes on, as it does when ``complete`` fails.

With ``on_loop_max_s`` (the broker's ``fsync_on_loop_ms`` under ``sync``), the flushes that
answer waiting writes run their fsyncs on the event loop's own thread while the disk keeps up:
no hand-off to the fsync threads and back, each of which waits for a core that the clients'
processes also want (W3's latency tail; bench/results/goals-2026-11-29.md). The disk keeps up
while the median of the last ``_RECENT`` flushes is under the bound and no flush took
``_STALL_TIMES`` the bound (a single slow one on a busy machine is the scheduler's, not the
disk's). Otherwise the flushes go back to the fsync threads for ``_THREAD_HOLD_S``, and while
they stay slow, again after it: a slow or stalled disk then stops only the answers that wait
for it. The periodic flush always runs on the fsync threads.

One group commit may cover a second log (``actions()``: the broker's action log beside its
message log): each flush fsyncs both, and writes to either wait for the same flushes. One
fsync pass covers sends, acks and the records of pulls alike, and a pull woken by a flush
(its messages just became visible) has its record covered by the very next one, rather than
queueing behind a second log's own fsync already under way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait

from qmq.serving.replies import Reply, call_reply
from qmq.store.segments import FlushTicket

log = logging.getLogger(__name__)

# after the disk fell behind (see the module's docstring), the flushes run on the fsync threads
# for this long before the loop tries again
_THREAD_HOLD_S = 10.0
_RECENT = 15  # flushes whose median says whether the disk keeps up
_STALL_TIMES = 20  # one flush this many times the bound: a stall


class GroupCommit:
    def __init__(
        self,
        what: str,
        begin: Callable[[], FlushTicket],
        complete: Callable[[FlushTicket], None],
        observe_seconds: Callable[[float], None],
        on_failure: Callable[[BaseException], None],
        on_loop_max_s: float = 0.0,
    ) -> None:
        self.what = what  # "the message log", "the write-ahead log": named in errors
        self.begin = begin
        self.complete = complete
        self.observe_seconds = observe_seconds
        self.on_failure = on_failure
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="qmq-fsync")
        # a ticket's second log is fsynced on a thread of its own, at the same time as the first
        # (FlushTicket.parts); started from the fsync thread, so a flush costs the event loop one
        # hand-off either way
        self._aside = ThreadPoolExecutor(1, thread_name_prefix="qmq-fsync-aside")
        self._waiting: deque[tuple[int, Reply]] = deque()
        self._waiting_actions: deque[tuple[int, Reply]] = deque()  # on the second log (``actions``)
        self._task: asyncio.Task[None] | None = None
        self._in_order = asyncio.Lock()
        self._periodic: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None
        self.flushed_offset = 0
        self.on_loop_max_s = on_loop_max_s  # 0: every flush on the fsync threads
        self._threads_until = 0.0  # monotonic time until which flushes stay on the fsync threads
        self._recent: deque[float] = deque(maxlen=_RECENT)  # the last flushes' seconds
        self.flushes_on_loop = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._waiting_actions)

    def after_write(self, end_offset: int, reply: Reply) -> None:
        """Call ``reply`` once everything up to ``end_offset`` is fsynced."""
        self._waiting.append((end_offset, reply))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    def after_action(self, end_offset: int, reply: Reply) -> None:
        """Call ``reply`` once the second log (see ``actions``) is fsynced up to ``end_offset``."""
        self._waiting_actions.append((end_offset, reply))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    def actions(self) -> ActionCommit:
        """The view of this commit that waits on its second log (tickets' ``action_offset``)."""
        return ActionCommit(self)

    async def _drain(self) -> None:
        try:
            while (self._waiting or self._waiting_actions) and self.failed is None:
                if self.on_loop_max_s:
                    await asyncio.sleep(0)  # a flush on the loop: first take what has arrived meanwhile
                await self.flush_once(on_loop=True)
        except OSError:
            pass  # flush_once answered every waiting write and reported the failure
        finally:
            self._task = None

    async def flush_once(self, on_loop: bool = False) -> None:
        """One flush; with ``on_loop`` (the flushes that answer waiting writes) its fsyncs may run
        on the loop's thread (``on_loop_max_s``)."""
        # one ticket at a time, begun and finished in order: a ticket hands the segments rolled
        # since the last to its own fsync, so a later one finishing first would answer writes
        # whose bytes an earlier one has still to make durable
        async with self._in_order:
            await self._flush_once(on_loop and self.on_loop_max_s > 0 and time.monotonic() >= self._threads_until)

    async def _flush_once(self, on_loop: bool) -> None:
        ticket = self.begin()
        t0 = time.perf_counter()
        try:
            if on_loop:
                self.flushes_on_loop += 1
                self._run_here(ticket)
            else:
                await asyncio.get_running_loop().run_in_executor(self.executor, self._run, ticket)
        except OSError as exc:
            # After a failed fsync the page cache state is unknown: stop taking writes.
            self.failed = exc
            log.critical("fsync of %s failed: %s; no more writes are taken", self.what, exc)
            for waiting in (self._waiting, self._waiting_actions):
                while waiting:
                    call_reply(waiting.popleft()[1], f"fsync of {self.what} failed: {exc}")
            self.on_failure(exc)
            raise
        took = time.perf_counter() - t0
        self.observe_seconds(took)
        if self.on_loop_max_s:
            self._judge_disk(took, on_loop)
        self.flushed_offset = max(self.flushed_offset, ticket.offset)
        try:
            self.complete(ticket)
        except Exception:  # a bug in what the role makes true after a flush: its writes are durable all the same
            log.exception("completing a flush of %s failed; the writes it covered are answered", self.what)
        waiting = self._waiting
        while waiting and waiting[0][0] <= ticket.offset:
            call_reply(waiting.popleft()[1], None)
        waiting = self._waiting_actions
        while waiting and waiting[0][0] <= ticket.action_offset:
            call_reply(waiting.popleft()[1], None)

    def _run(self, ticket: FlushTicket) -> None:
        """The ticket's fsyncs, its parts at the same time (on the fsync thread)."""
        first, *rest = ticket.parts()
        aside = [self._aside.submit(part) for part in rest]
        try:
            first()
        finally:
            wait(aside)  # every part ends (and closes its descriptors) whatever the first did
        for future in aside:
            future.result()  # raises what the part raised

    def _judge_disk(self, took: float, on_loop: bool) -> None:
        """After a flush of ``took`` seconds: whether the next ones stay off the loop."""
        recent = self._recent
        recent.append(took)
        bound = self.on_loop_max_s
        stalled = took > bound * _STALL_TIMES
        behind = len(recent) == recent.maxlen and sorted(recent)[len(recent) // 2] > bound
        if not (stalled or behind):
            return
        if on_loop:
            log.warning(
                "flushes of %s on the event loop take too long (this one %.1f ms, the median of the last %d "
                "%.1f ms; fsync_on_loop_ms %.0f): flushing on the fsync threads for %.0f s",
                self.what,
                took * 1000,
                len(recent),
                sorted(recent)[len(recent) // 2] * 1000,
                bound * 1000,
                _THREAD_HOLD_S,
            )
        self._threads_until = time.monotonic() + _THREAD_HOLD_S
        recent.clear()

    @staticmethod
    def _run_here(ticket: FlushTicket) -> None:
        """The ticket's fsyncs one after the other on this thread (the loop's); every part runs
        (and closes its descriptors) whatever an earlier one raised, which is then raised."""
        failure: OSError | None = None
        for part in ticket.parts():
            try:
                part()
            except OSError as exc:
                failure = failure or exc
        if failure is not None:
            raise failure

    def start_periodic(self, interval_ms: int) -> None:
        self._periodic = asyncio.get_running_loop().create_task(self._every(interval_ms / 1000))

    async def _every(self, interval_s: float) -> None:
        while True:
            await asyncio.sleep(interval_s)  # the periodic flush policy's period
            try:
                await self.flush_once()
            except OSError:
                return

    async def drain(self, deadline_s: float) -> bool:
        """Wait until every waiting write is answered (or the deadline passes); True if all were."""
        end = time.monotonic() + deadline_s
        while (self._waiting or self._waiting_actions) and time.monotonic() < end and self.failed is None:
            task = self._task
            if task is None:
                try:
                    await self.flush_once()
                except OSError:
                    break
            else:
                await asyncio.wait([task], timeout=max(0.0, end - time.monotonic()))
        return not self._waiting and not self._waiting_actions

    async def stop(self) -> None:
        if self._periodic is not None:
            self._periodic.cancel()
            await asyncio.gather(self._periodic, return_exceptions=True)
        self.executor.shutdown(wait=True)
        self._aside.shutdown(wait=True)


class ActionCommit:
    """A group commit's second log seen as a commit of its own: ``after_write`` waits on the
    tickets' ``action_offset``; flushing, draining and stopping are the shared commit's."""

    def __init__(self, shared: GroupCommit) -> None:
        self.shared = shared

    @property
    def failed(self) -> BaseException | None:
        return self.shared.failed

    @property
    def waiting(self) -> int:
        return len(self.shared._waiting_actions)

    def after_write(self, end_offset: int, reply: Reply) -> None:
        self.shared.after_action(end_offset, reply)

    async def flush_once(self) -> None:
        await self.shared.flush_once()

    async def drain(self, deadline_s: float) -> bool:
        return await self.shared.drain(deadline_s)
