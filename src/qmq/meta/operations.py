"""Cluster operations by hand (docs/cluster.md, "Operations"): drain and undrain a broker group,
add and retire a subject's routes, remove a drained group for good; each recorded in the
history with who asked, when and what.

Logic over the registry and the operations' rows, with no asyncio: the meta server calls it on
its one store thread, like the registry. Each operation is refused (OperationRefusedError, the
message naming the subject or group and what to do) when it would lose data or leave a subject
with nowhere to be sent:

- drain: every subject routed to the group must keep another available, writable group;
- retire a route: the subject must keep another available, writable group;
- remove a group: it must be draining, and its master must have reported, while it already
  refused sends, that nothing in it is left unconsumed by any consumer group.

What clients see: ``GET /meta/address`` marks each broker group ``writable`` and gives each
subject's ``send_routes`` (its routes less draining groups and retired routes); consumers keep
pulling every route. A draining master is told so in its heartbeat answer and refuses sends,
so a producer that has not refreshed yet sends the frame again to the subject's next group.

The group states and retired routes are cached for ``cache_ms`` (the address answer is the hot
path); a change by another meta server sharing the store is seen within that, and the routes
cache of the registry is read again when the history shows an operation made elsewhere.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Final

from qmq.common.clock import Clock
from qmq.common.errors import QmqError
from qmq.meta.operations_store import Backlog, GroupState, HistoryEntry, OperationsStore
from qmq.meta.payload import PayloadError
from qmq.meta.read_cache import ReadCache
from qmq.meta.registry import READ_CACHE_MS, Registry, UnknownGroupError
from qmq.meta.schema import SUBJECT_CHARS
from qmq.meta.store import MetaStore

log = logging.getLogger(__name__)

DRAINING: Final = "draining"
REMOVED: Final = "removed"
# Subjects a drain checks for another writable group; a group holding more is drained
# without the check for the rest, and the answer says so.
SUBJECTS_CHECKED_MAX: Final = 100_000
HISTORY_LIMIT_MAX: Final = 10_000
# (subject, consumer group, left) pairs a report may list (the broker lists 20)
UNCONSUMED_TOP_MAX: Final = 100


class OperationRefusedError(QmqError):
    """An operation would lose data or strand a subject; the message names which and what to do."""


class GroupRemovedError(QmqError):
    """A server reported itself in a group removed for good; the message says when and by whom."""


@dataclass(frozen=True, slots=True)
class Done:
    """An operation carried out: what the history recorded."""

    action: str
    target: str
    detail: str


class Operations:
    """Drain, routes, removal and history over ``registry`` and the operations' rows."""

    def __init__(
        self,
        store: MetaStore,
        registry: Registry,
        clock: Clock,
        *,
        heartbeat_timeout_ms: int,
        cache_ms: int = READ_CACHE_MS,
    ) -> None:
        self._store = store
        self._rows = OperationsStore(store)
        self._registry = registry
        self._clock = clock
        self._timeout_ms = heartbeat_timeout_ms
        self._states: dict[tuple[str, str], GroupState] = {}
        self._retired: dict[str, set[str]] = {}
        self._history_seen = 0
        self._changes = 0  # how often the group states or retired routes changed (in routes_version)
        self._cache = ReadCache(clock, cache_ms / 1000, self._reload, "the group states")
        self._reload()

    # -- what clients and servers see ------------------------------------------------------

    def _reload(self) -> None:
        states = self._rows.group_states()
        retired = self._rows.route_removals()
        if states != self._states or retired != self._retired:
            self._changes += 1
        self._states = states
        self._retired = retired
        last = self._rows.last_history_id()
        if last != self._history_seen:
            self._history_seen = last
            self._registry.reload_routes()
        self._cache.loaded()

    def _fresh(self) -> None:
        self._cache.fresh()

    def unwritable(self) -> set[str]:
        """Broker groups that take no new sends: draining or removed."""
        self._fresh()
        return {g for (role, g), _s in self._states.items() if role == "broker"}

    def is_draining(self, role: str, group: str) -> bool:
        self._fresh()
        s = self._states.get((role, group))
        return s is not None and s.state == DRAINING

    def check_registration(self, role: str, group: str) -> None:
        """GroupRemovedError when ``group`` was removed for good."""
        self._fresh()
        s = self._states.get((role, group))
        if s is not None and s.state == REMOVED:
            raise GroupRemovedError(
                f"{role} group {group!r} was removed for good (`qmq admin remove-group`) by {s.changed_by} "
                f"at {s.changed_at_ms} ms; it takes no servers: start this one with another --group"
            )

    def send_routes(self, routes: dict[str, list[str]]) -> dict[str, list[str]]:
        """Each subject's groups to send to: its routes less unwritable groups and retired routes."""
        unwritable = self.unwritable()
        return {
            s: [g for g in gs if g not in unwritable and g not in self._retired.get(s, ())] for s, gs in routes.items()
        }

    def decorate_address(self, body: dict[str, Any]) -> None:
        """Add ``writable`` to each broker group, ``send_routes`` and ``routes_version`` (changed by
        any change of a route or of what send routes leave out) to a ``GET /meta/address`` answer."""
        unwritable = self.unwritable()
        for g in body["broker_groups"]:
            g["writable"] = g["group"] not in unwritable
        body["send_routes"] = self.send_routes(body["routes"])
        body["routes_version"] = f"{self._registry.routes_version()}.{self._changes}"

    def record_backlog(self, role: str, group: str, address: str, report: dict[str, Any]) -> None:
        """Keep a master's report of what it holds unconsumed (its heartbeat's ``unconsumed``)."""
        top = [(str(s), None if g is None else str(g), int(n)) for s, g, n in report["top"]]
        backlog = Backlog(
            address, int(report["total"]), int(report["pairs"]), top, bool(report["draining"]), self._clock.now_ms()
        )
        self._rows.save_backlog(role, group, backlog)

    def decorate_cluster(self, view: dict[str, Any]) -> None:
        """Add each group's ``operation`` state and what is left to a ``GET /meta/cluster`` answer."""
        self._fresh()
        backlogs = self._rows.backlogs()
        now_ms = self._clock.now_ms()
        for g in view["groups"]:
            key = (g["role"], g["group"])
            backlog = self._fresh_backlog(backlogs.get(key), g["master"], now_ms)
            g["left"] = None if backlog is None else backlog.total
            g["left_top"] = [] if backlog is None else [list(item) for item in backlog.top]
            g["operation"] = self._operation_state(key, backlog)
        view["routes_retired"] = {s: sorted(gs) for s, gs in sorted(self._retired.items()) if s in view["routes"]}
        view["removed_groups"] = [
            {"role": s.role, "group": s.group, "removed_at_ms": s.changed_at_ms, "removed_by": s.changed_by}
            for _k, s in sorted(self._states.items())
            if s.state == REMOVED
        ]

    def _fresh_backlog(self, backlog: Backlog | None, master: str, now_ms: int) -> Backlog | None:
        if backlog is None or backlog.address != master or now_ms - backlog.reported_ms > self._timeout_ms:
            return None
        return backlog

    def _operation_state(self, key: tuple[str, str], backlog: Backlog | None) -> str:
        s = self._states.get(key)
        if s is None or s.state != DRAINING:
            return "writable"
        if backlog is not None and backlog.draining and backlog.total == 0:
            return "drained"
        return "draining"

    # -- operations ------------------------------------------------------------------------

    def _group(self, role: str, group: str) -> None:
        if not any(g.role == role and g.group == group for g in self._registry.group_records()):
            known = sorted(g.group for g in self._registry.group_records() if g.role == role)
            raise UnknownGroupError(
                f"no {role} group {group!r} has registered with the meta server; "
                f"{role} groups: {', '.join(known) if known else 'none'}"
            )

    def _writable_elsewhere(self, subject: str, routes: list[str], but: str) -> list[str]:
        available = {g.group for g in self._registry.groups("broker") if g.state == "available"}
        unwritable = self.unwritable()
        retired = self._retired.get(subject, set())
        return [g for g in routes if g != but and g in available and g not in unwritable and g not in retired]

    def drain(self, group: str, who: str) -> Done:
        """Take ``group`` out of writing: producers go to each subject's other groups, consumers go on."""
        self._reload()
        self._group("broker", group)
        state = self._states.get(("broker", group))
        if state is not None and state.state == DRAINING:
            raise OperationRefusedError(
                f"broker group {group!r} is draining already (since {state.changed_at_ms} ms, by {state.changed_by}); "
                "`qmq cluster status` shows what is left"
            )
        routes = self._rows.routes_sharing(group, SUBJECTS_CHECKED_MAX)
        subjects = sorted(routes)
        for subject in subjects:
            if not self._writable_elsewhere(subject, routes.get(subject, []), group):
                raise OperationRefusedError(
                    f"cannot drain broker group {group!r}: subject {subject!r} would have no other available, "
                    f"writable broker group (its routes: {', '.join(routes.get(subject, [])) or 'none'}); "
                    f"add one first: `qmq admin routes {subject} --add GROUP`"
                )
        now_ms = self._clock.now_ms()
        self._rows.set_group_state("broker", group, DRAINING, now_ms, who)
        checked = f" (the first {SUBJECTS_CHECKED_MAX:,} checked)" if len(subjects) >= SUBJECTS_CHECKED_MAX else ""
        done = Done(
            "drain", group, f"no new sends; {len(subjects)} subject(s) routed to it go to their other groups{checked}"
        )
        return self._record(now_ms, who, done)

    def undrain(self, group: str, who: str) -> Done:
        """Make a draining group writable again."""
        self._reload()
        self._group("broker", group)
        state = self._states.get(("broker", group))
        if state is None or state.state != DRAINING:
            raise OperationRefusedError(f"broker group {group!r} is not draining; nothing to undo")
        now_ms = self._clock.now_ms()
        self._rows.set_group_state("broker", group, None, now_ms, who)
        return self._record(now_ms, who, Done("undrain", group, "writable again"))

    def routes_of(self, subject: str) -> list[dict[str, Any]]:
        """The subject's routes, each with its state: "active", "retiring", or "draining" (the group)."""
        self._fresh()
        # routed now if it never was, as a client's lookup would
        routes = self._registry.routes([subject], self.unwritable()).get(subject, [])
        backlogs = self._rows.backlogs()
        out = []
        for g in routes:
            s = self._states.get(("broker", g))
            state = "retiring" if g in self._retired.get(subject, ()) else DRAINING if s is not None else "active"
            backlog = backlogs.get(("broker", g))
            left = None
            if backlog is not None and backlog.pairs <= len(backlog.top):  # the report lists every pair
                left = sum(n for subj, _cg, n in backlog.top if subj == subject)
            out.append({"group": g, "state": state, "left": left})
        return out

    def add_route(self, subject: str, group: str, who: str) -> Done:
        """Route ``subject`` to ``group`` too (or stop retiring that route)."""
        self._reload()
        self._group("broker", group)
        if ("broker", group) in self._states:
            raise OperationRefusedError(
                f"broker group {group!r} is draining: it takes no new sends; `qmq admin undrain {group}` first"
            )
        now_ms = self._clock.now_ms()
        if self._rows.restore_route(subject, group):
            done = Done("route-add", f"{subject} {group}", "the retired route takes sends again")
        else:
            have = self._store.routes_of(subject)
            if group in have:
                raise OperationRefusedError(f"subject {subject!r} is routed to broker group {group!r} already")
            self._store.add_routes(subject, [group], now_ms)
            done = Done("route-add", f"{subject} {group}", f"routes before: {', '.join(have) or 'none'}")
        return self._record(now_ms, who, done)

    def remove_route(self, subject: str, group: str, who: str) -> Done:
        """Retire ``subject``'s route to ``group``: no new sends there, consumers take what it holds."""
        self._reload()
        routes = self._store.routes_of(subject)
        if group not in routes:
            raise OperationRefusedError(
                f"subject {subject!r} is not routed to broker group {group!r}; "
                f"its routes: {', '.join(routes) or 'none'}"
            )
        if group in self._retired.get(subject, ()):
            raise OperationRefusedError(f"subject {subject!r}'s route to broker group {group!r} is retiring already")
        if not self._writable_elsewhere(subject, routes, group):
            raise OperationRefusedError(
                f"cannot remove broker group {group!r} from subject {subject!r}: no other available, writable group "
                f"would take its sends (its routes: {', '.join(routes)}); add one first: "
                f"`qmq admin routes {subject} --add GROUP`"
            )
        now_ms = self._clock.now_ms()
        self._rows.retire_route(subject, group, now_ms, who)
        done = Done("route-remove", f"{subject} {group}", "no new sends; consumers keep pulling what it holds")
        return self._record(now_ms, who, done)

    def remove_group(self, group: str, who: str) -> Done:
        """Unregister a drained broker group for good."""
        self._reload()
        self._group("broker", group)
        state = self._states.get(("broker", group))
        if state is None or state.state != DRAINING:
            raise OperationRefusedError(
                f"broker group {group!r} is writable; drain it first (`qmq admin drain {group}`), let its consumers "
                "empty it, then remove it"
            )
        [record] = [g for g in self._registry.group_records() if g.role == "broker" and g.group == group]
        backlog = self._fresh_backlog(self._rows.backlogs().get(("broker", group)), record.master, self._clock.now_ms())
        if backlog is None or not backlog.draining:
            raise OperationRefusedError(
                f"broker group {group!r}: its master {record.master} has not reported what it holds since it "
                f"stopped taking sends (is it running?); what is unconsumed there is unknown, so it is kept. "
                "Try again once `qmq cluster status` shows it drained"
            )
        if backlog.total:
            subject, consumer_group, left = backlog.top[0]
            who_left = f"consumer group {consumer_group!r}" if consumer_group is not None else "any consumer group"
            raise OperationRefusedError(
                f"cannot remove broker group {group!r}: {backlog.total:,} message(s) in it are unconsumed, e.g. "
                f"{left:,} of subject {subject!r} by {who_left} ({backlog.pairs} subject/consumer group pair(s) in "
                "all); let the consumers empty it (`qmq cluster status` shows what is left)"
            )
        now_ms = self._clock.now_ms()
        self._rows.unregister_group("broker", group, now_ms, who)
        self._registry.reload()
        done = Done("remove-group", group, f"unregistered for good; its last master was {record.master}")
        return self._record(now_ms, who, done)

    def record_promotion(self, role: str, group: str, who: str, detail: str) -> None:
        """Put a promotion (by hand or automatic) in the history."""
        self._record(self._clock.now_ms(), who, Done("promote", f"{role} {group}", detail))

    def _record(self, now_ms: int, who: str, done: Done) -> Done:
        self._rows.record(now_ms, who, done.action, done.target, done.detail)
        log.warning("operation by %s: %s %s (%s)", who, done.action, done.target, done.detail)
        self._reload()
        return done

    def history(self, limit: int) -> list[HistoryEntry]:
        return self._rows.history(min(limit, HISTORY_LIMIT_MAX))


def parse_unconsumed(body: object) -> dict[str, Any] | None:
    """The ``unconsumed`` report of a register body (``qmq.broker.backlog``), checked; None when absent."""
    if not isinstance(body, dict) or body.get("unconsumed") is None:
        return None
    report = body["unconsumed"]
    problem = "it must be {total, pairs, top: [[subject, group or null, left], ...], draining}"
    if not isinstance(report, dict):
        raise PayloadError("unconsumed", f"unconsumed is a {type(report).__name__}; {problem}")
    for name in ("total", "pairs"):
        value = report.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise PayloadError("unconsumed", f"unconsumed.{name} = {value!r:.40}; {problem}")
    top = report.get("top")
    if not isinstance(top, list) or len(top) > UNCONSUMED_TOP_MAX:
        raise PayloadError("unconsumed", f"unconsumed.top is not a list of at most {UNCONSUMED_TOP_MAX}; {problem}")
    for item in top:
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not (item[1] is None or isinstance(item[1], str))
            or not isinstance(item[2], int)
            or len(item[0]) > SUBJECT_CHARS
            or (item[1] is not None and len(item[1]) > SUBJECT_CHARS)
        ):
            raise PayloadError("unconsumed", f"unconsumed.top holds {item!r:.80}; {problem}")
    return {"total": report["total"], "pairs": report["pairs"], "top": top, "draining": report.get("draining") is True}
