"""What the broker does for each request code. Answers go through ``Responder``s, so a
handler may answer at once (most) or later (a send waiting for fsync, a parked pull); a later
answer is ``guarded``, so its failure fails its own request only. Listings are answered one
page at a time (``listings.py``)."""

from __future__ import annotations

import logging
import operator
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from qmq.broker.ack_many import ack_many, acked_answer
from qmq.broker.admin_handlers import AdminHandlers
from qmq.broker.metrics import BrokerMetrics
from qmq.broker.pull_many import pull_many
from qmq.broker.pulls import ParkedPull, ParkedPulls
from qmq.broker.release import Release
from qmq.broker.replication import ReplicationSource, Replicator
from qmq.broker.settle import HOLD_MS_MAX, HeldPositions, give_back, normalized, retry_of, settled_positions
from qmq.common.config import BrokerConfig
from qmq.protocol.answers import encode_answer
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.protocol.message import ScannedMessage
from qmq.serving.connection import Responder
from qmq.serving.disk import disk_refusal
from qmq.serving.dispatch import Handler, RoleContext, RoleHandlers, answer_failure
from qmq.serving.group_commit import ActionCommit
from qmq.serving.replication import take_request
from qmq.serving.replies import guarded
from qmq.serving.requests import (
    BadRequest,
    get_bool,
    get_group,
    get_int,
    get_ranges,
    get_str,
    get_subject,
    get_tags,
)
from qmq.serving.tracing import ServerTracing, end_spans
from qmq.store import fileio
from qmq.store.broker_store import AppendResult, BrokerStore, PullResult
from qmq.store.progress import ConsumerProgress, GroupProgress, Progress
from qmq.store.redelivery import DEFAULT_MAX_RETRIES
from qmq.store.tags import RecordFilter, TagFilter

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger(__name__)

_ID_CHARS_MAX = 200
# ScannedMessage is a NamedTuple: reading the field by index halves the cost of the scan per frame
_DELIVER_AT_MS = operator.itemgetter(ScannedMessage._fields.index("deliver_at_ms"))
_TAG_FILTERS_CACHED_MAX = 4096
# the answer of most sends, packed once
_ALL_STORED = encode_answer({"errors": [], "duplicates": 0})
# what only a master does; a slave answers NOT_MASTER naming its master
_MASTER_ONLY = frozenset(
    {
        RequestCode.SEND_MESSAGES,
        RequestCode.PULL,
        RequestCode.PULL_MANY,
        RequestCode.ACK,
        RequestCode.ACK_MANY,
        RequestCode.SETTLE,
        RequestCode.RESET_OFFSET,
        RequestCode.RESEND_DEAD,
        RequestCode.PURGE_DEAD,
        RequestCode.REPLICATE,
    }
)


class BrokerContext(RoleContext, Protocol):
    """What the handlers read and call of the broker (``BrokerServer`` is one; a test builds a
    small one): its state, never its lifecycle."""

    @property
    def config(self) -> BrokerConfig: ...
    @property
    def store(self) -> BrokerStore: ...
    @property
    def metrics(self) -> BrokerMetrics: ...
    @property
    def parked(self) -> ParkedPulls: ...
    @property
    def release(self) -> Release: ...
    @property
    def action_flusher(self) -> ActionCommit: ...
    @property
    def source(self) -> ReplicationSource: ...
    @property
    def replicator(self) -> Replicator | None: ...
    @property
    def role(self) -> str: ...
    @property
    def epoch(self) -> int: ...
    @property
    def address(self) -> str: ...
    @property
    def draining(self) -> bool: ...
    @property
    def tracing(self) -> ServerTracing | None: ...


class Handlers(RoleHandlers):
    kind = "broker"

    def __init__(self, broker: BrokerContext) -> None:
        super().__init__(broker)
        self.broker, self.store, self.metrics = broker, broker.store, broker.metrics
        self._tag_filters: dict[tuple[tuple[str, ...], str], TagFilter] = {}
        self.held_positions = HeldPositions(broker, self._after_give_back)
        admin = AdminHandlers(broker)
        table: dict[int, Handler] = {
            RequestCode.SEND_MESSAGES: self.send,
            RequestCode.PULL: self.pull,
            RequestCode.PULL_MANY: lambda conn, frame: pull_many(self, conn, frame),
            RequestCode.ACK: self.ack,
            RequestCode.ACK_MANY: lambda conn, frame: ack_many(self, conn, frame),
            RequestCode.SETTLE: self.settle,
            RequestCode.SUBJECTS: admin.subjects,
            RequestCode.LAG: admin.lag,
            RequestCode.RESET_OFFSET: admin.reset_offset,
            RequestCode.DEAD_LETTERS: admin.dead_letters,
            RequestCode.RESEND_DEAD: admin.resend_dead,
            RequestCode.PURGE_DEAD: admin.purge_dead,
            RequestCode.READ: self.read,
            RequestCode.REPLICATE: self.replicate,
            RequestCode.TRACE: admin.trace,
        }
        for code in _MASTER_ONLY:
            table[code] = self._master_only(table[code])
        self.serve(table, self.metrics.requests, _unknown)

    def _master_only(self, handler: Handler) -> Handler:
        """``handler`` on a master; on a slave, NOT_MASTER naming the master."""
        broker = self.broker

        def on_master(conn: Responder, frame: Frame) -> None:
            if broker.role != "master":
                conn.respond(frame.code, frame.request_id, {"error": self._not_master()}, status=Status.NOT_MASTER)
                return
            handler(conn, frame)

        return on_master

    # -- commands ----------------------------------------------------------------------

    def _not_master(self) -> str:
        broker = self.broker
        master = broker.replicator.master if broker.replicator is not None else "unknown yet"
        return (
            f"broker {broker.address} is a slave of group {broker.config.group} (epoch {broker.epoch}); "
            f"its master is {master}: clients find masters through the meta server"
        )

    def refusal(self) -> tuple[Status, str] | None:
        broker = self.broker
        if broker.source.write_state() == "read-only":
            return Status.NOT_MASTER, broker.source.read_only_text()
        if broker.draining:
            # NOT_MASTER: the SDK sends the frame again to the subject's next group at once
            return (
                Status.NOT_MASTER,
                f"broker group {broker.config.group} is draining (`qmq admin drain`): it takes no new sends; "
                "send to the subject's other broker groups (the meta server lists them)",
            )
        if broker.stopping:
            return Status.SHUTTING_DOWN, "the broker is shutting down; send to another broker group or retry"
        # Refused before anything is written: BUSY, so producers (and delay servers handing
        # messages over) send to another broker group instead of giving the message up.
        if broker.flusher.failed is not None:
            return (
                Status.BUSY,
                f"the broker's disk failed ({broker.flusher.failed}); it takes no sends until it is restarted",
            )
        if self.store.failed is not None:
            return (
                Status.BUSY,
                f"the broker's store stopped taking writes ({self.store.failed}); it takes no sends until it is "
                "restarted",
            )
        return disk_refusal(self.free_space, self.store.unflushed_bytes, broker.config.pending_flush_bytes_max)

    def send(self, conn: Responder, frame: Frame) -> None:
        taken = self.take_send(conn, frame)
        if taken is None:
            return
        body, scanned, problems = taken
        store = self.store
        holds = max(map(_DELIVER_AT_MS, scanned), default=0) > self.broker.clock.now_ms()
        if holds and len(store.held) >= self.broker.config.held_messages_max:
            text = (
                f"the broker holds {len(store.held)} messages until they are due, its held_messages_max; "
                "retry shortly, or raise held_messages_max in the [broker] config"
            )
            conn.respond(frame.code, frame.request_id, {"error": text}, status=Status.BUSY)
            return
        tracing = self.broker.tracing
        spans = tracing.spans_of_frame("store", body, scanned) if tracing is not None else None
        result = self.storing(lambda: store.append(body, scanned, refused=problems))
        if holds:
            self.broker.release.schedule()
        self._answer_stored(conn, frame, result, spans)

    def _answer_stored(
        self, conn: Responder, frame: Frame, result: AppendResult, spans: list[Span] | None = None
    ) -> None:
        metrics = self.metrics
        if result.per_subject:
            metrics.stored(result.per_subject)
        if result.duplicates:
            metrics.duplicates.inc(result.duplicates)
        for err in result.errors:
            metrics.refused.labels(Status(err[1]).name).inc()
        if result.errors or result.duplicates:
            answer = encode_answer({"errors": result.errors, "duplicates": result.duplicates})
        else:
            answer = _ALL_STORED
        code, request_id = frame.code, frame.request_id
        end = self.store.mlog.end
        source = self.broker.source
        traced = fileio.tracing and self.store.sync_policy  # the I/O trace (store/iotrace.py)

        # Failures past this point come after the batch was written: it may be stored (and be
        # consumed) although the answer is an error. "outcome": "unknown" tells the producer to
        # retry on this group only, whose duplicate window drops the repeat.
        def replicated(error: str | None) -> None:
            if spans:
                end_spans(spans, error)
            if error is None:
                if traced:
                    fileio.trace_answer(self.store.mlog.segments, end)
                conn.respond(code, request_id, None, (answer,))
            else:
                conn.respond(code, request_id, {"error": error, "outcome": "unknown"}, status=Status.NOT_MASTER)

        def durable(error: str | None) -> None:
            if error is None:
                source.after_log_replicated(end, guarded(conn, code, request_id, replicated))
            else:
                if spans:
                    end_spans(spans, error)
                conn.respond(code, request_id, {"error": error, "outcome": "unknown"}, status=Status.INTERNAL_ERROR)

        if not self.store.sync_policy:
            durable(None)
            if result.per_subject:
                self.broker.parked.notify(set(result.per_subject))
            return
        # Also when nothing new was stored: duplicates may belong to a batch still waiting for fsync.
        self.broker.flusher.after_write(end, guarded(conn, code, request_id, durable))
        if result.per_subject:
            # long polls take the messages as the flush covering them begins (store/take.py)
            self.broker.parked.notify_at_flush(set(result.per_subject))

    def _group_and_consumer(self, frame: Frame, create: bool) -> tuple[GroupProgress, ConsumerProgress]:
        return self._group_and_consumer_of(frame.header, create)

    def _group_and_consumer_of(self, header: dict[str, object], create: bool) -> tuple[GroupProgress, ConsumerProgress]:
        subject = get_subject(header)
        group = get_group(header)
        consumer_id = get_str(header, "consumer_id", max_chars=_ID_CHARS_MAX)
        start = header.get("start", "latest")
        if get_bool(header, "broadcast"):
            # every consumer is its own group, from the latest message; '%' keeps the name apart from user groups
            group = f"{group}%{consumer_id}"
            start = "latest"
        if create:
            if start not in ("latest", "earliest"):
                raise BadRequest(f"'start' = {start!r} is not allowed; use 'latest' or 'earliest'")
            gp: GroupProgress | None = self.store.group(subject, group, start)
        else:
            gp = self.store.progress.get(subject, group)
        if gp is None:
            raise BadRequest(f"consumer group {group!r} has never pulled {subject!r}")
        cp = gp.consumers.get(consumer_id)
        if cp is None:
            if not create:
                raise BadRequest(f"consumer {consumer_id!r} of group {group!r} has never pulled {subject!r}")
            cp = gp.consumer(consumer_id)
        cp.last_seen_ms = self.broker.clock.now_ms()
        if not cp.since_ms:
            cp.since_ms = cp.last_seen_ms
        return gp, cp

    def pull(self, conn: Responder, frame: Frame) -> None:
        header = frame.header
        limits = self.limits
        max_n = get_int(header, "max", 1, limits.pull_messages_max)
        timeout_ms = get_int(header, "timeout_ms", 0, limits.pull_timeout_ms_max, default=0)
        session = get_str(header, "session", max_chars=_ID_CHARS_MAX)
        ack_ranges = get_ranges(header, "ack", required=False)
        tag_filter: RecordFilter | None = self._tag_filter(*get_tags(header, limits.tags_max))
        max_retries = get_int(header, "max_retries", 0, 1000, default=DEFAULT_MAX_RETRIES)
        ordered = get_bool(header, "ordered")
        if ordered and tag_filter is not None:
            raise BadRequest("an ordered pull cannot filter by tags; pull without 'tags', or without 'ordered'")
        gp, cp = self._group_and_consumer(frame, create=True)
        gp.max_retries = max_retries
        if ordered:
            gp.ordered = True  # from now on every consumer of the group is served by slot (ordered_take)
        group_filter = self.broker.parked.filters.get((gp.subject, gp.group))
        unheld = self._ack(gp, cp, ack_ranges)[1] if ack_ranges else 0
        if group_filter is not None:  # the group's server-side filter (qmq.broker.controls)
            if gp.ordered:  # refused after its acks: they take all the same
                raise BadRequest(
                    f"consumer group {gp.group!r} of {gp.subject!r} has a server-side filter ({group_filter.expr!r}) "
                    "and an ordered group takes whole slots, never filtered: clear the filter (qmq group filter "
                    f"{gp.subject} --group {gp.group} --clear) or consume this group unordered"
                )
            tag_filter = group_filter.with_tags(tag_filter)
        code, request_id = frame.code, frame.request_id
        metrics = self.metrics

        def answer(result: PullResult | None) -> None:
            if ack_ranges:
                # the acks it carried must be durable and reach the slave first, or a power loss
                # or a failover would deliver those again
                self._after_acks(conn, code, request_id, lambda error: send_answer(result, error), _as_is)
            elif result is not None:
                # the record of what this consumer was handed must be durable, and on the slave,
                # before it has the messages: after a power loss or a failover that forgot it, the
                # consumer's acks (by position in what it was handed) would not take, and it would
                # receive the messages again after those acks were answered. The messages too may
                # still wait for their fsync (a pull takes what is written: store/take.py): the
                # flush that covers the record, begun after it, covers them as well (one group
                # commit for both logs)
                end, messages_end = self.store.alog.end, self.store.mlog.end
                durable = guarded(conn, code, request_id, lambda error: handed(result, end, messages_end, error))
                if self.store.sync_policy:
                    self.broker.action_flusher.after_write(end, durable)
                else:
                    durable(None)
            else:
                send_answer(result, None)

        def handed(result: PullResult, end: int, messages_end: int, error: str | None) -> None:
            if error is not None:
                text = f"the pull could not be made durable ({error}); pull again once the broker is restarted"
                conn.respond(code, request_id, {"error": text}, status=Status.BUSY)
                return

            def replicated(_why_not: str | None) -> None:
                # a slave that will not have it soon (a read-only group): answered all the same
                if fileio.tracing and self.store.sync_policy:
                    fileio.trace_answer(self.store.alog.segments, end, "pull")
                    fileio.trace_answer(self.store.mlog.segments, messages_end, "pull")
                send_answer(result, None)

            self.broker.source.after_actions_replicated(end, guarded(conn, code, request_id, replicated))

        def send_answer(result: PullResult | None, acks_error: str | None) -> None:
            header: dict[str, object] = {"runs": [] if result is None else result.runs}
            if gp.ordered:
                # the consumer holds its slots while it pulls within this; the SDK stops starting
                # messages once it may have lapsed (client/ordered_listener.py)
                header["lease_ms"] = self.broker.config.ordered_lease_ms
            if acks_error is not None:
                header["acks_error"] = acks_error  # the client keeps those acks and sends them again
            elif unheld:
                header["acks_unheld"] = unheld  # acked positions this broker never handed out
            if result is None:
                metrics.pulls_empty.inc()
                conn.respond(code, request_id, header)
                return
            metrics.pulls_with_messages.inc()
            metrics.delivered(gp.subject, gp.group, result.messages, result.nbytes)
            conn.respond(code, request_id, header, result.chunks)

        if (gp.subject, gp.group) in self.broker.parked.paused:
            result = None  # a paused group's consumers get nothing (qmq.broker.controls)
        else:
            result = self.store.pull(gp, cp, session, max_n, tag_filter)
        if self.store.dispatched:
            self.broker.parked.notify_soon(gp.subject)  # others' long polls may have messages now
        elif self.store.settling_ms:
            self.broker.parked.notify_later(gp.subject, self.store.settling_ms)  # the group places slots then
        if result is not None or timeout_ms == 0 or self.broker.stopping or self.store.scan_cut:
            answer(result)  # a scan cut short is answered at once: the consumer's next pull goes on
            return
        parked = ParkedPull(
            conn,
            gp,
            cp,
            session,
            max_n,
            tag_filter,
            guarded(conn, code, request_id, answer),
            lambda exc: answer_failure(conn, Frame(code, request_id), exc),
        )
        self.broker.parked.park(parked, timeout_ms)

    # -- what PULL_MANY (broker/pull_many.py) does as PULL does ---------------------------

    def tag_filter(self, tags: tuple[str, ...], mode: str) -> TagFilter | None:
        return self._tag_filter(tags, mode)

    def group_and_consumer(self, header: dict[str, object], create: bool) -> tuple[GroupProgress, ConsumerProgress]:
        return self._group_and_consumer_of(header, create)

    def apply_acks(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> tuple[int, int]:
        """Apply acks: the ack offset after, and how many positions were never handed out here (``_ack``)."""
        return self._ack(gp, cp, ranges)

    def after_acks(self, conn: Responder, code: int, request_id: int, answer: Callable[[str | None], None]) -> None:
        """``answer(None)`` once the acks applied so far are durable and on the slave (``_after_acks``)."""
        self._after_acks(conn, code, request_id, answer)

    def after_actions(self, conn: Responder, code: int, request_id: int, answer: Callable[[str | None], None]) -> None:
        """``answer(None)`` once the action log written so far is durable and on the slave; see ``_after_acks``."""
        self._after_acks(conn, code, request_id, answer, _as_is)

    def _tag_filter(self, tags: tuple[str, ...], mode: str) -> TagFilter | None:
        if not tags:
            return None
        key = (tags, mode)
        tf = self._tag_filters.get(key)
        if tf is None:
            if len(self._tag_filters) >= _TAG_FILTERS_CACHED_MAX:
                self._tag_filters.clear()
            tf = self._tag_filters[key] = TagFilter(list(tags), mode)
        return tf

    def _ack(self, gp: GroupProgress, cp: ConsumerProgress, ranges: list[list[int]]) -> tuple[int, int]:
        """Apply acks: the ack offset after, and how many positions they named that this broker
        never handed out to the consumer (a pull a failover or a power loss undid: store/progress.py),
        which the answer tells (``unheld``) so the SDK does not count those acks as done."""
        unheld = Progress.unheld(cp, ranges)
        before = cp.ack_offset + sum(e - s for s, e in cp.acked)
        ack_offset = self.store.ack(gp, cp, ranges)
        after = cp.ack_offset + sum(e - s for s, e in cp.acked)
        if after > before:
            self.metrics.acked(gp.subject, gp.group, after - before)
        if unheld:
            log.info(
                "%d acked positions of consumer %r (%r, group %r) were never handed out by this broker "
                "(pulled from a master since replaced, or undone by a power loss): their messages come again",
                unheld,
                cp.consumer_id,
                gp.subject,
                gp.group,
            )
        return ack_offset, unheld

    def ack(self, conn: Responder, frame: Frame) -> None:
        ranges = get_ranges(frame.header, "ranges")
        gp, cp = self._group_and_consumer(frame, create=False)
        answer = acked_answer(*self._ack(gp, cp, ranges))
        code, request_id = frame.code, frame.request_id

        # answered OK once the acks are durable and reached the slave: an answered ack survives
        # a power loss and a failover
        def replicated(error: str | None) -> None:
            if error is None:
                conn.respond(code, request_id, answer)
            else:
                conn.respond(code, request_id, {"error": error}, status=Status.BUSY)

        self._after_acks(conn, code, request_id, replicated)

    def _after_acks(
        self,
        conn: Responder,
        code: int,
        request_id: int,
        answer: Callable[[str | None], None],
        unreplicated: Callable[[str], str] = lambda why: _unreplicated_acks(why),
    ) -> None:
        """Call ``answer(None)`` once the action log written so far is durable (under flush =
        "sync": the action log's group commit; under "periodic" it is fsynced within
        flush_interval_ms) and on the slave; ``answer(why not)`` when it will not be (the client
        sends the acks again: they repeat safely)."""
        store = self.store
        end = store.alog.end
        source = self.broker.source
        traced = fileio.tracing and store.sync_policy  # the I/O trace (store/iotrace.py)

        def replicated(error: str | None) -> None:
            if error is None and traced:
                fileio.trace_answer(store.alog.segments, end, "ack")
            answer(None if error is None else unreplicated(error))

        def durable(error: str | None) -> None:
            if error is None:
                source.after_actions_replicated(end, guarded(conn, code, request_id, replicated))
            else:
                answer(f"the acks are recorded on this master but their fsync failed ({error}); send them again")

        if store.sync_policy:
            self.broker.action_flusher.after_write(end, guarded(conn, code, request_id, durable))
        else:
            source.after_actions_replicated(end, guarded(conn, code, request_id, replicated))

    def settle(self, conn: Responder, frame: Frame) -> None:
        """SETTLE (broker/settle.py): ``ack``, ``give_back`` and ``hold`` (with ``hold_ms``) ranges
        of one consumer's pull log; answered ``{settled, given_back_before, given_back, held}`` once the acks reached
        the slave and the retry copies are durable."""
        header = frame.header
        acks = normalized(get_ranges(header, "ack", required=False))
        backs = normalized(get_ranges(header, "give_back", required=False))
        holds = normalized(get_ranges(header, "hold", required=False))
        hold_ms = get_int(header, "hold_ms", 0, HOLD_MS_MAX, default=0)
        gp, cp = self._group_and_consumer(frame, create=False)
        # what was settled before this request: acked, or given back (its ack timeout passed)
        settled = settled_positions(cp, acks) + settled_positions(cp, backs)
        if acks:
            self._ack(gp, cp, acks)
        moved = give_back(self.store, gp, cp, backs, self.held_positions.given) if backs else 0
        held = False
        if holds:
            held = self.held_positions.hold(gp, cp.consumer_id, holds, self.broker.clock.now_ms() + hold_ms)
        code, request_id = frame.code, frame.request_id
        given = self.held_positions.given.among(gp, cp.consumer_id, settled)
        answer = {"settled": settled, "given_back_before": given, "given_back": moved, "held": held}

        def replicated(error: str | None) -> None:
            if error is None:
                conn.respond(code, request_id, answer)
            else:
                conn.respond(code, request_id, {"error": _unreplicated_acks(error)}, status=Status.BUSY)

        def durable(error: str | None) -> None:
            if error is not None:
                conn.respond(code, request_id, {"error": error}, status=Status.INTERNAL_ERROR)
                return
            if moved:
                self.broker.parked.notify({retry_of(gp)})
            self.broker.source.after_actions_replicated(
                self.store.alog.end, guarded(conn, code, request_id, replicated)
            )

        if moved and self.store.sync_policy:
            self.broker.flusher.after_write(self.store.mlog.end, guarded(conn, code, request_id, durable))
        else:
            durable(None)

    def _after_give_back(self, subjects: set[str]) -> None:
        if self.store.sync_policy:
            self.broker.flusher.after_write(self.store.mlog.end, lambda _error: None)
        else:
            self.broker.parked.notify(subjects)

    def read(self, conn: Responder, frame: Frame) -> None:
        header = frame.header
        subject = get_subject(header)
        from_seq = get_int(header, "from", 0, 1 << 62)
        max_n = get_int(header, "max", 1, self.limits.pull_messages_max)
        first, count, chunks = self.store.read_range(subject, from_seq, max_n)
        st = self.store.subjects.get(subject)
        bounds = {"start": st.clog.min_seq if st else 0, "end": st.visible_seq if st else 0}
        conn.respond(frame.code, frame.request_id, {"first": first, "count": count, **bounds}, chunks)

    def replicate(self, conn: Responder, frame: Frame) -> None:
        broker = self.broker
        take_request(broker.source, broker.epoch, conn, frame, self.limits.pull_timeout_ms_max)


def _unknown(code: int) -> str:
    return f"unknown command code {code}"


def _as_is(why: str) -> str:
    return why


def _unreplicated_acks(why: str) -> str:
    return f"the acks are recorded on this master but not yet on its slave ({why}); send them again"
