"""After a send from the outbox: delete the rows of sent messages, count failed sends.

Send outcomes arrive on the producer's I/O thread, which must never wait for a database;
they go into a bounded queue that one daemon thread drains in batches, each batch one
short transaction. When the queue is full or the database fails, the outcome is dropped
and logged: the row stays, and a watchdog resends it later (the broker's duplicate window
drops that repeat), so a lost outcome costs a resend, never a message.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass

import sqlalchemy as sa

from qmq.tx.rows import delete_rows, failure_params, record_failure

log = logging.getLogger(__name__)

_STOP = object()
# How often a run of drops is logged at most.
_DROP_LOG_INTERVAL_S = 10.0


@dataclass(slots=True)
class FinisherStats:
    rows_deleted: int = 0
    failures_recorded: int = 0
    outcomes_dropped: int = 0


class Finisher:
    """Applies send outcomes to an outbox table from a background thread (bounded queue)."""

    def __init__(self, engine: sa.Engine, table: sa.Table, *, queue_max: int, batch_max: int) -> None:
        self._engine = engine
        self._delete = delete_rows(table)
        self._record_failure = record_failure(table)
        self._batch_max = batch_max
        self._queue: queue.Queue[object] = queue.Queue(queue_max)
        self.stats = FinisherStats()
        self._last_drop_log = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"qmq-outbox-{table.name}", daemon=True)
        self._thread.start()

    def sent(self, row_id: int) -> None:
        """The message of ``row_id`` is stored by the broker: delete the row (never blocks)."""
        self._put((row_id, None))

    def failed(self, row_id: int, error: BaseException | str) -> None:
        """The send of ``row_id`` failed for good: count the attempt (never blocks)."""
        self._put((row_id, error))

    def _put(self, item: tuple[int, BaseException | str | None]) -> None:
        try:
            self._queue.put_nowait(item)
        except queue.Full:
            self._dropped(1, "the finisher queue is full")

    def _dropped(self, n: int, why: str) -> None:
        self.stats.outcomes_dropped += n
        now = time.monotonic()
        if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
            self._last_drop_log = now
            log.warning(
                "outbox: %s; %d send outcome(s) dropped so far: their rows stay and a watchdog resends them",
                why,
                self.stats.outcomes_dropped,
            )

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            batch = [item]
            while len(batch) < self._batch_max:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
            stop = any(b is _STOP for b in batch)
            outcomes = [b for b in batch if b is not _STOP]
            if outcomes:
                self._apply(outcomes)  # type: ignore[arg-type]
            if stop:
                return

    def _apply(self, outcomes: list[tuple[int, BaseException | str | None]]) -> None:
        sent = [row_id for row_id, error in outcomes if error is None]
        failed = [failure_params(row_id, error) for row_id, error in outcomes if error is not None]
        try:
            with self._engine.begin() as conn:
                if sent:
                    conn.execute(self._delete, {"ids": sent})
                if failed:
                    conn.execute(self._record_failure, failed)
        except sa.exc.SQLAlchemyError as exc:
            self._dropped(len(outcomes), f"applying send outcomes failed ({exc.__class__.__name__}: {exc})")
            return
        self.stats.rows_deleted += len(sent)
        self.stats.failures_recorded += len(failed)

    def close(self, timeout_s: float) -> None:
        """Apply what is queued (waiting up to ``timeout_s``), then stop the thread."""
        if not self._thread.is_alive():
            return
        try:
            self._queue.put(_STOP, timeout=timeout_s)
        except queue.Full:
            log.warning("outbox: finisher queue still full after %.1f s; its outcomes are dropped", timeout_s)
            return
        self._thread.join(timeout_s)
