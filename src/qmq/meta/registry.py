"""The registry: which servers are alive, what each group's epoch and master are, and where
subjects go.

Logic over a MetaStore and a clock; no asyncio, no locks. The meta server calls it from one
thread only, so no two calls ever overlap. The rules of each decision are in
``qmq.meta.decisions``; this module reads what they need, and writes what they decide.

Several meta servers may share the store. So the servers and groups held in memory are a
cache of the store, read again when older than ``cache_ms`` (a server registered at another
meta server is seen here within that), and every decision starts from the group's row as
stored and is written only if that row did not change meanwhile.

A group is "available" while its master (the address in its row) heartbeats: its last
report is at most ``heartbeat_timeout_ms`` old.

Routing: the first time a subject is asked for, it is routed to ``route_groups`` available
broker groups, those with the fewest subjects first (ties by name), and the routes are
stored. A subject with fewer groups than ``route_groups`` gains more as more become
available; a route is never removed, so a subject's messages are always found where they
were sent.
"""

from __future__ import annotations

import logging
import secrets
from collections import Counter
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final, Literal

from qmq.common.clock import Clock
from qmq.common.errors import QmqError
from qmq.meta.decisions import (
    ROLES,
    ROLES_IN_GROUP,
    Registration,
    Role,
    RoleInGroup,
    candidates,
    decide,
    is_fresh,
    promoted,
    slave_addresses,
)
from qmq.meta.read_cache import ReadCache
from qmq.meta.store import GroupRecord, MetaStore, MetaStoreError, ServerRecord

__all__ = [
    "ROLES",
    "ROLES_IN_GROUP",
    "STATES",
    "GroupView",
    "Heartbeat",
    "Promotion",
    "PromotionRefusedError",
    "Registration",
    "Registry",
    "RegistryCounts",
    "RegistryFullError",
    "Reported",
    "State",
    "UnknownGroupError",
]

log = logging.getLogger(__name__)

State = Literal["available", "unavailable"]

STATES: Final = ("available", "unavailable")

# Bounds on what clients and servers can make the registry hold in memory. A deployment
# has tens of servers and thousands of subjects; these are orders of magnitude above.
SERVERS_MAX: Final = 4096
SUBJECTS_MAX: Final = 1_000_000
# How stale the servers and groups read from the store may be: a meta server sharing the
# store sees another's registrations within this (well inside one heartbeat).
READ_CACHE_MS: Final = 1_000
# A server silent this long is forgotten (unless it is its group's master): servers restarted on
# new ports (port 0) would otherwise pile up towards SERVERS_MAX. One that comes back registers anew.
SERVER_FORGET_MS: Final = 24 * 3600 * 1000
# A full registry makes room for a new server by forgetting those silent this long (or ten
# heartbeat timeouts, if longer), except each group's master: one-off registrations (a client
# posting junk, servers restarted on new ports) hold a slot for minutes, not SERVER_FORGET_MS.
ROOM_SILENT_MS_MIN: Final = 60_000
# A decision whose group row changed under it is made again from the new row, this many times.
_DECIDE_ATTEMPTS_MAX: Final = 3


class RegistryFullError(QmqError):
    """The registry holds as many servers or subjects as it may; the message says which."""


class UnknownGroupError(QmqError):
    """No group of that role and name has registered; the message lists those that have."""


class PromotionRefusedError(QmqError):
    """A promotion cannot be done now; the message names the group and why."""


@dataclass(frozen=True, slots=True)
class GroupView:
    """A group as clients see it: its master's addresses and whether it is available."""

    role: Role
    group: str
    address: str
    http: str
    state: State


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The answer to a server's report: what it must be (docs/cluster.md, "Heartbeat answer")."""

    role_in_group: RoleInGroup
    epoch: int
    master: str | None
    slaves: int
    truncate: tuple[int, int] | None
    # to a master: the slaves heartbeating, whose REPLICATE requests it counts (anyone may send one)
    slave_addresses: tuple[str, ...] = ()


@dataclass(frozen=True, slots=True)
class Reported:
    """A report taken: whether it registered a new process, and the answer to send back."""

    is_new: bool
    answer: Heartbeat


@dataclass(frozen=True, slots=True)
class Promotion:
    """A slave made master: the group's new row and the master it replaced."""

    group: GroupRecord
    previous_master: str
    manual: bool


@dataclass(frozen=True, slots=True)
class RegistryCounts:
    """Sizes for metrics: groups by (role, state), subjects routed, (subject, group) routes."""

    groups: dict[tuple[str, str], int]
    subjects: int
    routes: int


class Registry:
    """Registered servers, group decisions and subject routes, cached and written through to the store."""

    def __init__(
        self,
        store: MetaStore,
        clock: Clock,
        *,
        heartbeat_timeout_ms: int,
        route_groups: int,
        owner: str = "meta",
        cache_ms: int = READ_CACHE_MS,
    ) -> None:
        if heartbeat_timeout_ms <= 0:
            raise ValueError(f"heartbeat_timeout_ms must be positive, got {heartbeat_timeout_ms}")
        if route_groups <= 0:
            raise ValueError(f"route_groups must be positive, got {route_groups}")
        self._store = store
        self._clock = clock
        self.heartbeat_timeout_ms = heartbeat_timeout_ms
        self._route_groups = route_groups
        self._owner = owner
        self._cache_s = cache_ms / 1000
        self._servers: dict[tuple[str, str, str], ServerRecord] = {}
        # The same records by group, so a heartbeat looks at its group's servers only.
        self._by_group: dict[tuple[str, str], dict[str, ServerRecord]] = {}
        self._groups: dict[tuple[str, str], GroupRecord] = {}
        self._cache = ReadCache(clock, self._cache_s, self.reload, "the servers and groups")
        self.reload()
        # When this registry started, and when the store last heard from any server: the time
        # the meta servers went away, if they did (see _heard_now_ms).
        self._started_ms = clock.now_ms()
        newest = max((r.last_heartbeat_ms for r in self._servers.values()), default=self._started_ms)
        self._heard_until_ms = min(newest, self._started_ms)
        self._routes: dict[str, list[str]] = store.routes()
        # When an incomplete route was last read from the store (another meta server may widen it).
        self._route_read_at: dict[str, float] = {}
        self._subjects_per_group: Counter[str] = Counter(g for gs in self._routes.values() for g in gs)
        # What routes_version is made of: this registry's own token (another meta server, or this
        # one restarted, has another) and how often a route a client may hold changed.
        self._routes_epoch = secrets.token_hex(4)
        self._route_changes = 0
        # Groups whose master is gone with no slave to promote, logged once until that changes.
        self._stuck: set[tuple[str, str]] = set()

    # -- reading ---------------------------------------------------------------------------

    def reload(self) -> None:
        """Read the servers and groups from the store now."""
        servers = self._store.servers()
        groups = self._store.groups()
        self._servers = {(r.role, r.group, r.address): r for r in servers}
        self._by_group = {}
        for r in servers:
            self._by_group.setdefault((r.role, r.group), {})[r.address] = r
        self._groups = {(g.role, g.group): g for g in groups}
        self._cache.loaded()

    def _fresh(self) -> None:
        self._cache.fresh()

    def _heard_now_ms(self) -> int:
        """Now, for telling who is silent. For the first ``heartbeat_timeout_ms`` after this
        registry started, the last time the store heard from any server: a meta server just
        (re)started has heard nobody yet, and the silence while the meta servers were away is
        not the servers' (a rolling restart must not make clients drop every group, nor promote
        a slave whose heartbeat came before its master's). A server silent before that is silent."""
        now_ms = self._clock.now_ms()
        if now_ms - self._started_ms >= self.heartbeat_timeout_ms:
            return now_ms
        return min(now_ms, self._heard_until_ms)

    def _members(self, role: str, group: str) -> list[ServerRecord]:
        members = self._by_group.get((role, group), {})
        return [members[a] for a in sorted(members)]

    def _master_of(self, group: GroupRecord) -> ServerRecord | None:
        return self._servers.get((group.role, group.group, group.master))

    def servers(self) -> list[ServerRecord]:
        """Every server as it last reported, by role, group and address."""
        self._fresh()
        return [r for _k, r in sorted(self._servers.items())]

    def group_records(self) -> list[GroupRecord]:
        """Every group's row, by role and name."""
        self._fresh()
        return [g for _k, g in sorted(self._groups.items())]

    def groups(self, role: Role) -> list[GroupView]:
        """Every group of ``role`` with a master, sorted by name."""
        self._fresh()
        now_ms = self._heard_now_ms()
        out = []
        for (r, name), g in sorted(self._groups.items()):
            master = self._master_of(g)
            if r != role or master is None:
                continue
            state: State = "available" if is_fresh(master, now_ms, self.heartbeat_timeout_ms) else "unavailable"
            out.append(GroupView(role=role, group=name, address=g.master, http=master.http, state=state))
        return out

    # -- reports ---------------------------------------------------------------------------

    def register(self, reg: Registration) -> Reported:
        """Record a report from a server and decide what it must be.

        ``is_new`` is True for a new registration, False for a heartbeat; a report from an
        address already known under another pid is a new registration: the process restarted.
        """
        self._fresh()
        now_ms = self._clock.now_ms()
        key = (reg.role, reg.group, reg.address)
        old = self._servers.get(key)
        if old is None and len(self._servers) >= SERVERS_MAX:
            self._make_room(now_ms)
        if old is None and len(self._servers) >= SERVERS_MAX:
            raise RegistryFullError(
                f"the meta server already holds {SERVERS_MAX} servers, none of them silent long enough to be "
                f"forgotten; cannot register {reg.role} {reg.address} of group {reg.group!r}"
            )
        is_new = old is None or old.pid != reg.pid
        record = ServerRecord(
            role=reg.role,
            group=reg.group,
            address=reg.address,
            http=reg.http,
            pid=reg.pid,
            role_in_group=reg.role_in_group,
            registered_at_ms=now_ms if is_new or old is None else old.registered_at_ms,
            last_heartbeat_ms=now_ms,
            epoch=reg.epoch,
            log_end=reg.log_end,
            action_end=reg.action_end,
            replicated_ms=reg.replicated_ms,
            write_state=reg.write_state,
        )
        # Store first: when the write fails, memory still says what the store says.
        self._store.save_server(record)
        self._servers[key] = record
        self._by_group.setdefault((reg.role, reg.group), {})[reg.address] = record
        return Reported(is_new, self._answer(reg, now_ms))

    def _answer(self, reg: Registration, now_ms: int) -> Heartbeat:
        # The group's row as stored, not as cached: another meta server may have just promoted.
        group = self._store.group(reg.role, reg.group)
        for _ in range(_DECIDE_ATTEMPTS_MAX):
            master = None if group is None else self._master_of(group)
            decision = decide(reg, group, master, now_ms=now_ms, by=self._owner)
            after = decision.group_after
            if after is None:
                break
            if group is None:
                stored = self._store.create_group(after)
                if stored == after:
                    log.info(
                        "%s group %r: %s is its first master, epoch %d", reg.role, reg.group, reg.address, after.epoch
                    )
                    group = after
                    break
                group = stored  # another meta server created it first: decide again from its row
            elif self._store.change_group(group, after):
                log.info(
                    "%s group %r: master %s, epoch %d (was %s, epoch %d)",
                    reg.role,
                    reg.group,
                    after.master,
                    after.epoch,
                    group.master,
                    group.epoch,
                )
                group = after
                break
            else:
                group = self._store.group(reg.role, reg.group)
        else:
            raise MetaStoreError(
                f"group {reg.group!r} kept changing while the report of {reg.address} was decided; "
                "the server's next heartbeat tries again"
            )
        if group is None:
            return Heartbeat("slave", 0, None, 0, None)
        self._groups[(group.role, group.group)] = group
        truncate = None
        if decision.cut_after_epoch is not None:
            truncate = self._store.offsets_after(group.role, group.group, decision.cut_after_epoch)
        is_master = decision.role_in_group == "master"
        named = slave_addresses(group, self._members(reg.role, reg.group), now_ms, self.heartbeat_timeout_ms)
        return Heartbeat(
            decision.role_in_group,
            group.epoch,
            None if is_master else group.master,
            len(named),
            truncate,
            named if is_master else (),
        )

    # -- promotion -------------------------------------------------------------------------

    def check_promotions(self) -> list[Promotion]:
        """Promote a slave in every group whose master is silent past the timeout, where one may be.

        The caller makes sure this meta server leads and automatic promotion is on.
        """
        self.reload()  # decisions start from the store, not from a cache
        now_ms = self._heard_now_ms()
        done = []
        for key, group in sorted(self._groups.items()):
            master = self._master_of(group)
            if master is not None and is_fresh(master, now_ms, self.heartbeat_timeout_ms):
                self._stuck.discard(key)
                continue
            eligible, reasons = candidates(
                group, self._members(*key), master, now_ms=now_ms, timeout_ms=self.heartbeat_timeout_ms
            )
            if not eligible:
                if key not in self._stuck:
                    self._stuck.add(key)
                    log.warning(
                        "%s group %r: master %s is silent and no slave can take over%s",
                        group.role,
                        group.group,
                        group.master,
                        (": " + "; ".join(reasons)) if reasons else "",
                    )
                continue
            self._stuck.discard(key)
            promotion = self._promote(group, eligible[0], now_ms, manual=False)
            if promotion is not None:
                done.append(promotion)
        return done

    def _make_room(self, now_ms: int) -> None:
        """Forget the servers (not masters) silent for ROOM_SILENT_MS_MIN or ten heartbeat timeouts."""
        silent_ms = max(ROOM_SILENT_MS_MIN, 10 * self.heartbeat_timeout_ms)
        forgotten = self._store.forget_servers(now_ms - silent_ms)
        if forgotten:
            log.warning(
                "the registry was full (%d servers): forgot %d silent for %d s or more",
                SERVERS_MAX,
                forgotten,
                silent_ms // 1000,
            )
            self.reload()

    def forget_silent(self) -> int:
        """Forget the servers silent for SERVER_FORGET_MS, except each group's master; how many.

        The caller makes sure this meta server leads, so meta servers do not all delete at once.
        """
        forgotten = self._store.forget_servers(self._clock.now_ms() - SERVER_FORGET_MS)
        if forgotten:
            log.info("forgot %d server(s) silent for %d h", forgotten, SERVER_FORGET_MS // 3_600_000)
            self.reload()
        return forgotten

    def promote(self, role: Role, group_name: str) -> Promotion:
        """Make the group's freshest slave its master now (``qmq admin promote``).

        UnknownGroupError when no such group registered; PromotionRefusedError naming the group
        when no slave may take over (saying why of each) or the group changed meanwhile.
        """
        self.reload()
        group = self._groups.get((role, group_name))
        if group is None:
            known = sorted(g for (r, g) in self._groups if r == role)
            raise UnknownGroupError(
                f"no {role} group {group_name!r} has registered with the meta server; "
                f"{role} groups: {', '.join(known) if known else 'none'}"
            )
        now_ms = self._clock.now_ms()
        eligible, reasons = candidates(
            group,
            self._members(role, group_name),
            self._master_of(group),
            now_ms=now_ms,
            timeout_ms=self.heartbeat_timeout_ms,
        )
        if not eligible:
            why = "; ".join(reasons) if reasons else "it has no slave"
            raise PromotionRefusedError(
                f"{role} group {group_name!r} has no fresh slave to promote ({why}); "
                "start a slave (--role slave) and let it catch up, then try again"
            )
        promotion = self._promote(group, eligible[0], now_ms, manual=True)
        if promotion is None:
            raise PromotionRefusedError(
                f"{role} group {group_name!r} changed while it was being promoted (another meta server "
                "decided first); look at `qmq cluster status` and try again if still needed"
            )
        return promotion

    def _promote(self, group: GroupRecord, slave: ServerRecord, now_ms: int, *, manual: bool) -> Promotion | None:
        after = promoted(group, slave, now_ms=now_ms, by=self._owner)
        if not self._store.change_group(group, after):
            self.reload()
            return None
        self._groups[(group.role, group.group)] = after
        log.warning(
            "%s group %r: promoted %s to master, epoch %d, from message offset %d, action offset %d (was %s, %s)",
            group.role,
            group.group,
            slave.address,
            after.epoch,
            after.message_offset,
            after.action_offset,
            group.master,
            "by hand" if manual else "silent past the heartbeat timeout",
        )
        return Promotion(after, group.master, manual)

    # -- routes ----------------------------------------------------------------------------

    def routes(self, subjects: Iterable[str], exclude: Collection[str] = ()) -> dict[str, list[str]]:
        """The broker groups of each subject (sorted), routing the ones not yet routed in full
        to available groups not in ``exclude`` (groups draining: docs/cluster.md, "Operations").

        A subject stays unrouted (an empty list) while no broker group is available. The store
        is read once for the subjects it must be asked about, and written once for the routes
        made or widened: a request of 256 new subjects is two transactions, not 512.
        """
        groups = [g.group for g in self.groups("broker") if g.state == "available"]
        available = [g for g in groups if g not in exclude]
        wanted = list(dict.fromkeys(subjects))
        self._read_routes([s for s in wanted if self._may_have_changed(s, groups)])
        plans: dict[str, list[str]] = {}
        for subject in wanted:
            current = self._routes.get(subject, [])
            missing = self._route_groups - len(current)
            if missing <= 0:
                continue
            have = set(current)
            picks = sorted((g for g in available if g not in have), key=lambda g: (self._subjects_per_group[g], g))
            extra = picks[:missing]
            if not extra:
                continue
            if subject not in self._routes and len(self._routes) + len(plans) >= SUBJECTS_MAX:
                raise RegistryFullError(
                    f"the meta server already routes {SUBJECTS_MAX} subjects; cannot route {subject!r}"
                )
            plans[subject] = extra
            if current:  # widened: a client holding the narrower route must ask again
                self._route_changes += 1
            self._subjects_per_group.update(extra)  # the next new subject of this request sees them
        if plans:
            for subject, routed in self._store.add_routes_many(plans, self._clock.now_ms()).items():
                self._routes[subject] = routed
        return {s: list(self._routes.get(s, ())) for s in wanted}

    def _may_have_changed(self, subject: str, groups: list[str]) -> bool:
        """Whether the store may know more of ``subject``'s route than this registry holds: it
        was never read, or it is incomplete, some available group (of ``groups``) is not in it
        (another meta server sharing the store may have widened it with that one), and it was
        last read over ``cache_ms`` ago. A route holding every available group can be widened by
        nobody until another group becomes available: it is not read again (a standalone's
        one group under ``route_groups`` = 2 made every route of every refresh one more read)."""
        current = self._routes.get(subject)
        if current is None:
            return True
        if len(current) >= self._route_groups or all(g in current for g in groups):
            return False
        return self._clock.monotonic() - self._route_read_at.get(subject, -self._cache_s) >= self._cache_s

    def _read_routes(self, subjects: list[str]) -> None:
        if not subjects:
            return
        stored = self._store.routes_of_many(subjects)
        mono = self._clock.monotonic()
        for subject in subjects:
            current = stored.get(subject)
            held = self._routes.get(subject)
            if held is not None and held != current:  # widened or removed through another meta server
                self._route_changes += 1
            if current:
                self._routes[subject] = current
            else:  # removed from the store (or never routed): routed anew
                self._routes.pop(subject, None)
            if current and len(current) < self._route_groups:
                self._route_read_at[subject] = mono
            else:
                self._route_read_at.pop(subject, None)

    def reload_routes(self) -> None:
        """Read every route from the store again (an operator added or removed one)."""
        routes = self._store.routes()
        if routes != self._routes:
            self._route_changes += 1
        self._routes = routes
        self._route_read_at.clear()
        self._subjects_per_group = Counter(g for gs in self._routes.values() for g in gs)

    def routes_version(self) -> str:
        """A token that changes whenever a route already answered may have changed (widened,
        removed, reloaded) in this registry; a route made for a new subject leaves it as it is.
        A client whose token is still the one of its last full refresh asks only for the
        subjects it has no route for (qmq.client.meta)."""
        return f"{self._routes_epoch}.{self._route_changes}"

    def counts(self) -> RegistryCounts:
        groups = {(role, state): 0 for role in ROLES for state in STATES}
        for role in ROLES:
            for g in self.groups(role):
                groups[(role, g.state)] += 1
        return RegistryCounts(
            groups=groups,
            subjects=len(self._routes),
            routes=sum(len(gs) for gs in self._routes.values()),
        )
