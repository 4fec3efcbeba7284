"""Group commit: writes wait for one fdatasync that covers many of them.

Under the ``sync`` policy a write is answered only when an fsync that started after it has
returned. While one fsync runs on the worker thread, every write made meanwhile waits for the
next one, so many producers share each fsync. Under ``periodic`` a write is answered once
written and a timer fsyncs every ``flush_interval_ms``.

The role says what one flush covers (``begin``: fds and the offset they reach, on the loop)
and what becomes true once it has (``complete``: e.g. messages made visible to consumers).
Each waiting write's reply runs through ``call_reply``: one that fails is logged and the
others are answered; the flush task goes on, as it does when ``complete`` fails.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

from qmq.serving.replies import Reply, call_reply
from qmq.store.segments import FlushTicket

log = logging.getLogger(__name__)


class GroupCommit:
    def __init__(
        self,
        what: str,
        begin: Callable[[], FlushTicket],
        complete: Callable[[FlushTicket], None],
        observe_seconds: Callable[[float], None],
        on_failure: Callable[[BaseException], None],
    ) -> None:
        self.what = what  # "the message log", "the write-ahead log": named in errors
        self.begin = begin
        self.complete = complete
        self.observe_seconds = observe_seconds
        self.on_failure = on_failure
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="qmq-fsync")
        self._waiting: deque[tuple[int, Reply]] = deque()
        self._task: asyncio.Task[None] | None = None
        self._periodic: asyncio.Task[None] | None = None
        self.failed: BaseException | None = None
        self.flushed_offset = 0

    @property
    def waiting(self) -> int:
        return len(self._waiting)

    def after_write(self, end_offset: int, reply: Reply) -> None:
        """Call ``reply`` once everything up to ``end_offset`` is fsynced."""
        self._waiting.append((end_offset, reply))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._drain())

    async def _drain(self) -> None:
        try:
            while self._waiting and self.failed is None:
                await self.flush_once()
        except OSError:
            pass  # flush_once answered every waiting write and reported the failure
        finally:
            self._task = None

    async def flush_once(self) -> None:
        ticket = self.begin()
        t0 = time.perf_counter()
        try:
            await asyncio.get_running_loop().run_in_executor(self.executor, ticket.run)
        except OSError as exc:
            # After a failed fsync the page cache state is unknown: stop taking writes.
            self.failed = exc
            log.critical("fsync of %s failed: %s; no more writes are taken", self.what, exc)
            while self._waiting:
                call_reply(self._waiting.popleft()[1], f"fsync of {self.what} failed: {exc}")
            self.on_failure(exc)
            raise
        self.observe_seconds(time.perf_counter() - t0)
        self.flushed_offset = max(self.flushed_offset, ticket.offset)
        try:
            self.complete(ticket)
        except Exception:  # a bug in what the role makes true after a flush: its writes are durable all the same
            log.exception("completing a flush of %s failed; the writes it covered are answered", self.what)
        waiting = self._waiting
        while waiting and waiting[0][0] <= ticket.offset:
            call_reply(waiting.popleft()[1], None)

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
        while self._waiting and time.monotonic() < end and self.failed is None:
            task = self._task
            if task is None:
                try:
                    await self.flush_once()
                except OSError:
                    break
            else:
                await asyncio.wait([task], timeout=max(0.0, end - time.monotonic()))
        return not self._waiting

    async def stop(self) -> None:
        if self._periodic is not None:
            self._periodic.cancel()
            await asyncio.gather(self._periodic, return_exceptions=True)
        self.executor.shutdown(wait=True)
