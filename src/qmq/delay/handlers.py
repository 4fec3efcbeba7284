"""What the delay server does for each request code: PING, SEND_MESSAGES (the broker's contract,
answered once the write-ahead log is durable and, in a group with a slave, written there too),
DELAY_STATS, CANCEL_DELAY (answered, when it cancelled something, as a send is), DELAY_LIST
(listing.py) and REPLICATE (a slave's copying: replica.py). A slave answers SEND_MESSAGES
and CANCEL_DELAY with NOT_MASTER naming its master. Other commands are a broker's and are
refused with UNKNOWN_COMMAND saying so."""

from __future__ import annotations

import asyncio
import functools
from collections import deque
from concurrent.futures import Executor
from typing import Protocol

from qmq.common.config import DelayConfig
from qmq.delay.cancel import Written
from qmq.delay.dispatcher import Dispatcher
from qmq.delay.listing import LIST_ITEMS_MAX, buckets_to_list, list_pending
from qmq.delay.metrics import DelayMetrics
from qmq.delay.scheduler import Scheduler
from qmq.delay.store import DelayStore
from qmq.delay.timer import Rows
from qmq.protocol.answers import Page, encode_answer
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.disk import disk_refusal
from qmq.serving.dispatch import Handler, RoleContext, RoleHandlers
from qmq.serving.replication import ReplicationSource, Replicator, take_request
from qmq.serving.replies import Reply, guarded
from qmq.serving.requests import BadRequest, get_int, get_str
from qmq.serving.tracing import ServerTracing, end_spans
from qmq.store import fileio

STATS_BUCKETS_DEFAULT = 100
# Every bucket of the default horizon (730 days of one-hour buckets: 17,520). A bucket row is
# < 100 bytes of the answer document, in the body: 2 MB at most, far inside frame_bytes_max.
STATS_BUCKETS_MAX = 20_000
_TIME_MS_MAX = 253_402_300_799_999  # the end of the year 9999, as a due time may be


class DelayContext(RoleContext, Protocol):
    """What the handlers read and call of the delay server (``DelayServer`` is one; a test
    builds a small one): its state and the hooks a stored send pulls, never its lifecycle."""

    @property
    def config(self) -> DelayConfig: ...
    @property
    def store(self) -> DelayStore: ...
    @property
    def metrics(self) -> DelayMetrics: ...
    @property
    def scheduler(self) -> Scheduler: ...
    @property
    def dispatcher(self) -> Dispatcher | None: ...
    @property
    def disk_error(self) -> BaseException | None: ...
    @property
    def checkpoint_executor(self) -> Executor:
        """The worker thread of checkpoints, background fsyncs and a cancel's search."""
        ...

    @property
    def unflushed(self) -> deque[tuple[int, Rows]]:
        """Timer rows of sends waiting for their fsync, by write-ahead log end offset (sync policy)."""
        ...

    def sync_in_background(self) -> None: ...
    def prepare_routes(self, subjects: list[str]) -> None: ...
    def poke_dispatcher(self) -> None: ...
    def arrived(self, rows: Rows) -> None: ...
    def release_durable(self) -> None: ...
    @property
    def tracing(self) -> ServerTracing | None: ...
    @property
    def address(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def source(self) -> ReplicationSource: ...
    @property
    def replicator(self) -> Replicator | None: ...
    def after_replicated(self, end: int, reply: Reply, replicated: Reply | None = None) -> None:
        """``reply`` once the write-ahead log to ``end`` is durable, then ``replicated`` once it is
        on the slave (with one), or with why it will not be."""
        ...


class Handlers(RoleHandlers):
    kind = "delay"

    def __init__(self, server: DelayContext) -> None:
        super().__init__(server)
        self.server, self.store, self.metrics = server, server.store, server.metrics
        table: dict[int, Handler] = {
            RequestCode.SEND_MESSAGES: self.send,
            RequestCode.DELAY_STATS: self.delay_stats,
            RequestCode.CANCEL_DELAY: self.cancel_delay,
            RequestCode.DELAY_LIST: self.delay_list,
            RequestCode.REPLICATE: self.replicate,
        }
        for code in (RequestCode.SEND_MESSAGES, RequestCode.CANCEL_DELAY):
            table[code] = self._master_only(table[code])
        self.serve(table, self.metrics.requests, self._unknown)

    def _unknown(self, code: int) -> str:
        return (
            f"command code {code} is not served by a delay server (group "
            f"{self.server.config.group}); it takes PING, SEND_MESSAGES, DELAY_STATS, CANCEL_DELAY and DELAY_LIST: "
            "pull from a broker"
        )

    def _master_only(self, handler: Handler) -> Handler:
        """``handler`` on a master; on a slave, NOT_MASTER naming the master (the producer asks the
        meta server again and sends there)."""
        server = self.server

        def on_master(conn: Responder, frame: Frame) -> None:
            if server.role != "master":
                replicator = server.replicator
                master = replicator.master if replicator is not None else "unknown yet"
                text = (
                    f"delay server {server.address} is a slave of delay group {server.config.group} "
                    f"(epoch {server.epoch}); its master is {master}: clients find masters through the meta server"
                )
                conn.respond(frame.code, frame.request_id, {"error": text}, status=Status.NOT_MASTER)
                return
            handler(conn, frame)

        return on_master

    def replicate(self, conn: Responder, frame: Frame) -> None:
        server = self.server
        if server.role != "master":
            text = f"delay server {server.address} is not master of its group; ask the meta server for the master"
            conn.respond(frame.code, frame.request_id, {"error": text}, status=Status.NOT_MASTER)
            return
        take_request(
            server.source, server.epoch, conn, frame, self.limits.pull_timeout_ms_max, ("token", "dispatch", "snapshot")
        )

    def refusal(self) -> tuple[Status, str] | None:
        server = self.server
        if server.source.write_state() == "read-only":
            return Status.NOT_MASTER, server.source.read_only_text()
        if server.stopping:
            return Status.SHUTTING_DOWN, "the delay server is shutting down; send to another delay group or retry"
        failed = server.flusher.failed or server.disk_error
        if failed is not None:
            # refused before anything is written: BUSY, so producers send to another delay group
            return Status.BUSY, f"the delay server's disk failed ({failed}); it takes no sends"
        unflushed_bytes = self.store.wal.end - server.flusher.flushed_offset
        return disk_refusal(self.free_space, unflushed_bytes, server.config.pending_flush_bytes_max)

    def send(self, conn: Responder, frame: Frame) -> None:
        taken = self.take_send(conn, frame)
        if taken is None:
            return
        body, scanned, problems = taken
        server = self.server
        store = self.store
        tracing = server.tracing
        spans = tracing.spans_of_frame("schedule", body, scanned) if tracing is not None else None
        result = self.storing(lambda: store.append(body, scanned, problems))
        metrics = self.metrics
        if result.stored:
            metrics.messages_in.inc(result.stored)
            metrics.bytes_in.inc(result.stored_bytes)
            server.sync_in_background()
        for err in result.errors:
            metrics.refused.labels(Status(err[1]).name).inc()
        if store.new_subjects:
            server.prepare_routes(store.new_subjects)
            store.new_subjects = []
        if store.created_bucket:
            store.created_bucket = False
            server.poke_dispatcher()  # a new bucket may need loading now
        # No "duplicates": a delay server keeps no duplicate window; a repeated send is dropped by
        # the broker's when both copies are handed over (docs/protocol.md).
        answer = encode_answer({"errors": result.errors})
        code, request_id = frame.code, frame.request_id
        end = store.wal.end
        if not store.sync_policy:
            server.arrived(result.arrivals)
        elif len(result.arrivals):
            server.unflushed.append((end, result.arrivals))

        def durable(error: str | None) -> None:
            if spans:
                end_spans(spans, error)
            try:
                if error is None:
                    if fileio.tracing:  # the I/O trace (store/iotrace.py)
                        fileio.trace_answer(store.wal.segments, end)
                    conn.respond(code, request_id, None, (answer,))
                else:  # written, fsync failed: it may or may not be kept
                    header = {"error": error, "outcome": "unknown"}
                    conn.respond(code, request_id, header, status=Status.INTERNAL_ERROR)
            finally:
                if store.sync_policy:
                    server.release_durable()

        def replicated(error: str | None) -> None:
            if error is None:
                durable(None)
                return
            # durable here, but this server is no longer master (or is stopping, or read-only)
            # before its slave said it has it: NOT_MASTER, so the producer sends it again at once
            # (a repeat is dropped by the broker's duplicate window when both are handed over)
            if spans:
                end_spans(spans, error)
            conn.respond(code, request_id, {"error": error, "outcome": "unknown"}, status=Status.NOT_MASTER)
            if store.sync_policy:
                server.release_durable()

        server.after_replicated(
            end, guarded(conn, code, request_id, durable), guarded(conn, code, request_id, replicated)
        )

    def cancel_delay(self, conn: Responder, frame: Frame) -> None:
        """``{"message_id"}`` → ``{"cancelled": bool, "copies": n}``: whether pending messages
        with that id were stopped (all of a repeating message's copies still pending). What the
        buckets have written is searched on the checkpoint thread (cancel.py), so a large
        backlog never holds up the loop; the rest, and the decision, on the loop."""
        if self._refused(conn, frame):
            return
        message_id = get_str(frame.header, "message_id", max_chars=self.limits.message_id_chars_max)
        server, store = self.server, self.store
        code, request_id = frame.code, frame.request_id
        job = store.cancel_search(message_id)
        try:
            searched = asyncio.get_running_loop().run_in_executor(server.checkpoint_executor, job)
        except RuntimeError:  # the executor is shut down: the server is stopping
            conn.respond(code, request_id, {"error": "the delay server is shutting down"}, status=Status.SHUTTING_DOWN)
            return

        def found(done: asyncio.Future[dict[int, Written]]) -> None:
            # re-checked: the server may have begun to stop meanwhile
            if done.cancelled() or self._refused(conn, frame):
                return
            written = done.result()  # an OSError is answered as the request's failure
            stopped = self.storing(lambda: store.cancel(message_id, server.scheduler, written))
            self._answer_cancel(conn, code, request_id, stopped)

        searched.add_done_callback(guarded(conn, code, request_id, found))

    def _refused(self, conn: Responder, frame: Frame) -> bool:
        refusal = self.refusal()
        if refusal is not None:
            conn.respond(frame.code, frame.request_id, {"error": refusal[1]}, status=refusal[0])
        return refusal is not None

    def _answer_cancel(self, conn: Responder, code: int, request_id: int, stopped: int) -> None:
        server, store = self.server, self.store
        answer = {"cancelled": stopped > 0, "copies": stopped}
        if not stopped:
            self.metrics.cancelled.inc(stopped)
            conn.respond(code, request_id, answer)
            return

        def durable(error: str | None) -> None:
            if error is None:
                self.metrics.cancelled.inc(stopped)
                conn.respond(code, request_id, answer)
            else:  # written, fsync failed: it may or may not be kept
                conn.respond(code, request_id, {"error": error, "outcome": "unknown"}, status=Status.INTERNAL_ERROR)

        def replicated(error: str | None) -> None:
            if error is None:
                durable(None)
            else:  # no longer master before the slave had it: the client asks the group's master again
                conn.respond(code, request_id, {"error": error, "outcome": "unknown"}, status=Status.NOT_MASTER)

        server.after_replicated(
            store.wal.end, guarded(conn, code, request_id, durable), guarded(conn, code, request_id, replicated)
        )

    def delay_list(self, conn: Responder, frame: Frame) -> None:
        """``{"subject", "from_ms"?, "to_ms"?, "limit"?, "after"?}`` → one page of the subject's
        pending messages by due time (listing.py)."""
        header = frame.header
        subject = get_str(header, "subject", max_chars=self.limits.internal_subject_chars_max)
        from_ms = get_int(header, "from_ms", 0, _TIME_MS_MAX, default=0)
        to_ms = get_int(header, "to_ms", 0, _TIME_MS_MAX, default=_TIME_MS_MAX)
        limit = get_int(header, "limit", 1, LIST_ITEMS_MAX, default=100)
        after = header.get("after")
        if after is not None and not (
            isinstance(after, list) and len(after) == 3 and all(type(x) is int for x in after)
        ):
            raise BadRequest(
                f"'after' = {after!r:.200} is not a DELAY_LIST cursor; pass back the 'next' of the last page"
            )
        store = self.store
        code, request_id = frame.code, frame.request_id
        store.flush_buffers()  # what the buckets hold, far ones' waiting messages too, is read from their files
        buckets = buckets_to_list(list(store.iter_buckets()), store.bucket_ms, from_ms, to_ms)
        job = functools.partial(list_pending, buckets, subject.encode("utf-8"), from_ms, to_ms, limit, after)
        try:
            listed = asyncio.get_running_loop().run_in_executor(self.server.checkpoint_executor, job)
        except RuntimeError:  # the executor is shut down: the server is stopping
            conn.respond(code, request_id, {"error": "the delay server is shutting down"}, status=Status.SHUTTING_DOWN)
            return

        def answer(done: asyncio.Future[tuple[Page, list[int] | None]]) -> None:
            if done.cancelled():
                return
            page, following = done.result()  # an OSError is answered as the request's failure
            fields: dict[str, object] = {"subject": subject}
            if following is not None:
                fields["next"] = following
            conn.respond(code, request_id, None, (encode_answer(fields, {"messages": page.items}),))

        listed.add_done_callback(guarded(conn, code, request_id, answer))

    def delay_stats(self, conn: Responder, frame: Frame) -> None:
        buckets_max = frame.header.get("buckets_max", STATS_BUCKETS_DEFAULT)
        is_int = isinstance(buckets_max, int) and not isinstance(buckets_max, bool)
        if not is_int or not 0 <= buckets_max <= STATS_BUCKETS_MAX:
            raise BadRequest(f"'buckets_max' = {buckets_max!r} must be a whole number from 0 to {STATS_BUCKETS_MAX}")
        server = self.server
        stats = server.scheduler.stats(buckets_max)
        d = server.dispatcher
        stats.update(
            {
                "group": server.config.group,
                "time_ms": server.clock.now_ms(),
                "bucket_ms": self.store.bucket_ms,
                "horizon_days": server.config.horizon_days,
                "dispatched_last_minute": d.dispatched_last_minute() if d else 0,
                "dispatched_total": d.dispatched_total if d else 0,
                "handover_in_flight": d.in_flight if d else 0,
            }
        )
        conn.respond(frame.code, frame.request_id, None, (encode_answer(stats),))
