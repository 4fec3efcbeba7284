"""PULL_MANY: one consumer pulls many (subject, group) pairs of this broker group in one request.

A consumer of many subjects (issue 27's W7: 1,000) would otherwise send one PULL per subject;
here one request names them all and one answer carries what each got, so the request costs,
the group commit's waits and the replication waits are paid once. The header::

    consumer_id, session           as PULL's
    max                            messages in the whole answer (each entry has its own too)
    timeout_ms                     (0) how long to wait when no entry has messages (long poll)
    pulls                          [{subject, group, max, [start], [broadcast], [tags], [tag_type],
                                     [max_retries], [ack]}, ...], at most PULL_MANY_ENTRIES_MAX
    share                          (false) the client reads results that refer to another's records

The answer's header is ``{"results": [...]}``, one per entry in order: ``{"runs", "bytes"}`` (the
entry's PULL runs and how many bytes of the body are its records, which follow the previous
entry's) or ``{"error", "status"}`` (that entry refused: a group that pulls ordered, a bad
subject), so one bad entry does not fail the others. With ``share``, an entry whose records are
byte for byte an earlier entry's (the consumer groups of a fan-out, pulled together, each get
the same records) has ``{"runs", "bytes": 0, "same": j}``: the records are entry ``j``'s, carried
once, and read and checked once by the client (issue 27's W9: 70 groups of one subject).
``acks_error`` as PULL's when the acks the entries carried could not be made durable or
replicated; an entry whose acks named positions this broker never handed out has
``acks_unheld`` (their count, as PULL's). With ``timeout_ms`` a request whose entries all found
nothing waits (``ParkedMany`` in broker/pulls.py) until one of its subjects
gets messages, when its entries are pulled again, or until the timeout, when it is answered
empty; without, it is answered at once. Like a PULL that handed out messages, it is answered
only once the action log is durable and on the slave. Entries past the request's ``max`` or
the broker's ``pull_bytes_max`` for the whole answer get empty results.

A broker that predates it answers UNKNOWN_COMMAND; the SDK then pulls subject by subject.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from qmq.broker.pulls import ParkedMany
from qmq.protocol.codes import Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.dispatch import answer_failure
from qmq.serving.requests import BadRequest, get_bool, get_int, get_ranges, get_str, get_tags
from qmq.store import fileio
from qmq.store.broker_store import PullResult
from qmq.store.redelivery import DEFAULT_MAX_RETRIES
from qmq.store.tags import RecordFilter

if TYPE_CHECKING:
    from qmq.broker.handlers import Handlers

PULL_MANY_ENTRIES_MAX = 2_000
_ID_CHARS_MAX = 200


def pull_many(handlers: Handlers, conn: Responder, frame: Frame) -> None:
    header = frame.header
    limits = handlers.limits
    consumer_id = get_str(header, "consumer_id", max_chars=_ID_CHARS_MAX)
    session = get_str(header, "session", max_chars=_ID_CHARS_MAX)
    total = get_int(header, "max", 1, limits.pull_messages_max * PULL_MANY_ENTRIES_MAX)
    timeout_ms = get_int(header, "timeout_ms", 0, limits.pull_timeout_ms_max, default=0)
    entries = header.get("pulls")
    if not isinstance(entries, list) or not entries:
        raise BadRequest("'pulls' must be a non-empty list of {subject, group, max} maps")
    if len(entries) > PULL_MANY_ENTRIES_MAX:
        raise BadRequest(f"'pulls' has {len(entries)} entries; at most {PULL_MANY_ENTRIES_MAX} a request")
    share = get_bool(header, "share")
    made = _Pulls(handlers, consumer_id, session, total, share=share)
    with handlers.store.shared_reads():
        made.run(entries)
    code, request_id = frame.code, frame.request_id
    if made.handed or timeout_ms == 0 or handlers.broker.stopping or not made.subjects:
        _answer(handlers, conn, code, request_id, made, made.acked, made.unheld)
        return
    # nothing yet: wait on every subject at once; the acks the entries carried were applied, so
    # the pulls made again carry none, and the answer still waits for them to be durable
    again = [{k: v for k, v in entry.items() if k != "ack"} if isinstance(entry, dict) else entry for entry in entries]
    acked, unheld = made.acked, made.unheld

    def retry() -> bool:
        more = _Pulls(handlers, consumer_id, session, total, again=True, share=share)
        with handlers.store.shared_reads():
            more.run(again)
        if not more.handed:
            return False
        _answer(handlers, conn, code, request_id, more, acked, unheld)
        return True

    parked = ParkedMany(
        conn,
        frozenset(made.subjects),
        retry,
        lambda: _answer(handlers, conn, code, request_id, made, acked, unheld),
        lambda exc: answer_failure(conn, Frame(code, request_id), exc),
    )
    handlers.broker.parked.park_many(parked, timeout_ms)


class _Pulls:
    """The pulls of one PULL_MANY's entries, made once (``run``): their results, the records'
    chunks, whether any carried acks or handed out messages, the subjects pulled."""

    def __init__(
        self, handlers: Handlers, consumer_id: str, session: str, total: int, again: bool = False, share: bool = False
    ) -> None:
        self.handlers = handlers
        # entries whose records are an earlier entry's refer to it (the request's ``share``): the
        # store hands groups pulling the same records the very chunks it read once
        # (``shared_reads``), so the chunks' identities name them; each is kept alive by the answer
        self.shared: dict[tuple[int, ...], int] | None = {} if share else None
        self.again = again  # a parked request's pulls made again: its empty entries were counted once
        self.consumer_id = consumer_id
        self.session = session
        self.left = total
        self.results: list[dict[str, object]] = []
        self.chunks: list[bytes] = []
        self.acked = False
        self.unheld: dict[int, int] = {}  # entry index -> acked positions never handed out here
        self.handed = False
        self.subjects: set[str] = set()

    def run(self, entries: list[object]) -> None:
        handlers = self.handlers
        budget = handlers.limits.pull_bytes_max
        metrics = handlers.metrics
        results = self.results
        for i, entry in enumerate(entries):
            if not isinstance(entry, dict):
                results.append({"error": f"a 'pulls' entry must be a map, got {type(entry).__name__}", "status": 1})
                continue
            try:
                named = {**entry, "consumer_id": self.consumer_id}
                result, had_acks, unheld = _one(handlers, named, self.session, self.left, budget)
            except BadRequest as exc:
                results.append({"error": str(exc), "status": int(Status.BAD_REQUEST)})
                continue
            subject, group = entry.get("subject"), entry.get("group")
            if isinstance(subject, str):
                self.subjects.add(subject)
            self.acked = self.acked or had_acks
            if unheld:
                self.unheld[i] = unheld
            if result is None:
                results.append({"runs": [], "bytes": 0})
                if not self.again:
                    metrics.pulls_empty.inc()
                continue
            self.handed = True
            self.left -= result.messages
            same = self._same(i, result.chunks)
            if same is None:
                results.append({"runs": result.runs, "bytes": result.nbytes})
                self.chunks.extend(result.chunks)
                budget -= result.nbytes
            else:
                results.append({"runs": result.runs, "bytes": 0, "same": same})
            metrics.pulls_with_messages.inc()
            metrics.delivered(str(subject), str(group), result.messages, result.nbytes)

    def _same(self, i: int, chunks: list[bytes]) -> int | None:
        """The earlier entry whose records are these ``chunks`` (entry ``i``'s), when the request
        shares them; otherwise None, and these are remembered for later entries."""
        shared = self.shared
        if shared is None or not chunks:
            return None
        key = tuple(map(id, chunks))
        j = shared.get(key)
        if j is None:
            shared[key] = i
        return j


def _answer(
    handlers: Handlers, conn: Responder, code: int, request_id: int, made: _Pulls, acked: bool, unheld: dict[int, int]
) -> None:
    results = made.results
    for i, n in unheld.items():
        results[i]["acks_unheld"] = n
    answer: dict[str, Any] = {"results": results}
    handed = made.handed
    if not acked and not handed:
        conn.respond(code, request_id, answer)
        return
    store = handlers.store
    traced = fileio.tracing and store.sync_policy and handed  # the I/O trace (store/iotrace.py)
    end, messages_end = store.alog.end, store.mlog.end
    chunks = made.chunks

    def send(error: str | None) -> None:
        if traced and error is None:
            fileio.trace_answer(store.alog.segments, end, "pull")
            fileio.trace_answer(store.mlog.segments, messages_end, "pull")
        if error is not None:
            if not handed:
                answer["acks_error"] = error  # the client keeps those acks and sends them again
            else:
                text = f"the pull could not be made durable ({error}); pull again"
                conn.respond(code, request_id, {"error": text}, status=Status.BUSY)
                return
        conn.respond(code, request_id, answer, chunks)

    # what the entries acked and the records of what they handed out (and the messages, which a
    # pull takes before their fsync: store/take.py), durable and on the slave before the answer
    handlers.after_actions(conn, code, request_id, send)


def _one(
    handlers: Handlers, entry: dict[str, object], session: str, left: int, budget: int
) -> tuple[PullResult | None, bool, int]:
    """One entry: its acks applied, then its pull made (None when it got nothing, or when the
    answer is full); whether it carried acks, and how many positions they named that this
    broker never handed out."""
    if (left <= 0 or budget <= 0) and "ack" not in entry:
        return None, False, 0  # the answer is full: nothing to do for this entry
    limits = handlers.limits
    max_n = get_int(entry, "max", 0, limits.pull_messages_max)  # 0: its acks only (a consume quota)
    ack_ranges = get_ranges(entry, "ack", required=False)
    tag_filter: RecordFilter | None = handlers.tag_filter(*get_tags(entry, limits.tags_max))
    max_retries = get_int(entry, "max_retries", 0, 1000, default=DEFAULT_MAX_RETRIES)
    if get_bool(entry, "ordered"):
        raise BadRequest("an ordered group is pulled with PULL, one subject a request")
    gp, cp = handlers.group_and_consumer(entry, create=True)
    if gp.ordered:
        raise BadRequest(f"group {gp.group!r} of {gp.subject!r} pulls ordered: pull it with PULL")
    gp.max_retries = max_retries
    parked = handlers.broker.parked
    group_filter = parked.filters.get((gp.subject, gp.group))
    if group_filter is not None:
        tag_filter = group_filter.with_tags(tag_filter)
    unheld = handlers.apply_acks(gp, cp, ack_ranges)[1] if ack_ranges else 0
    if max_n == 0 or left <= 0 or budget <= 0 or (gp.subject, gp.group) in parked.paused:
        return None, bool(ack_ranges), unheld
    result = handlers.store.pull(gp, cp, session, min(max_n, left), tag_filter, budget)
    return result, bool(ack_ranges), unheld
