"""The registry: which servers are alive, what each group's state is, and where subjects go.

Pure logic over a MetaStore and a clock; no asyncio, no locks. The meta server calls it from
one thread only, so no two calls ever overlap.

A group's entry is its master: the server of the group registered with role_in_group
"master" that reported itself last (after a promotion the new master reports, the old one
falls silent). The group is "available" while that master's last heartbeat is at most
``heartbeat_timeout_ms`` old.

Routing: the first time a subject is asked for, it is routed to ``route_groups`` available
broker groups, those with the fewest subjects first (ties by name), and the routes are
stored. A subject with fewer groups than ``route_groups`` gains more as more become
available; a route is never removed, so a subject's messages are always found where they
were sent.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final, Literal

from qmq.common.clock import Clock
from qmq.common.errors import QmqError
from qmq.meta.store import MetaStore, ServerRecord

Role = Literal["broker", "delay"]
RoleInGroup = Literal["master", "slave"]
State = Literal["available", "unavailable"]

ROLES: Final = ("broker", "delay")
ROLES_IN_GROUP: Final = ("master", "slave")
STATES: Final = ("available", "unavailable")

# Bounds on what clients and servers can make the registry hold in memory. A deployment
# has tens of servers and thousands of subjects; these are orders of magnitude above.
SERVERS_MAX: Final = 4096
SUBJECTS_MAX: Final = 1_000_000


class RegistryFullError(QmqError):
    """The registry holds as many servers or subjects as it may; the message says which."""


@dataclass(frozen=True, slots=True)
class Registration:
    """What a server reports about itself, first time and every heartbeat."""

    role: Role
    group: str
    address: str
    http: str
    pid: int
    role_in_group: RoleInGroup = "master"


@dataclass(frozen=True, slots=True)
class GroupView:
    """A group as clients see it: its master's addresses and whether it is available."""

    role: Role
    group: str
    address: str
    http: str
    state: State


@dataclass(frozen=True, slots=True)
class RegistryCounts:
    """Sizes for metrics: groups by (role, state), subjects routed, (subject, group) routes."""

    groups: dict[tuple[str, str], int]
    subjects: int
    routes: int


class Registry:
    """Registered servers and subject routes, cached in memory and written through to the store."""

    def __init__(
        self, store: MetaStore, clock: Clock, *, heartbeat_timeout_ms: int, route_groups: int
    ) -> None:
        if heartbeat_timeout_ms <= 0:
            raise ValueError(f"heartbeat_timeout_ms must be positive, got {heartbeat_timeout_ms}")
        if route_groups <= 0:
            raise ValueError(f"route_groups must be positive, got {route_groups}")
        self._store = store
        self._clock = clock
        self._heartbeat_timeout_ms = heartbeat_timeout_ms
        self._route_groups = route_groups
        self._servers: dict[tuple[str, str, str], ServerRecord] = {
            (r.role, r.group, r.address): r for r in store.servers()
        }
        self._routes: dict[str, list[str]] = store.routes()
        self._subjects_per_group: Counter[str] = Counter(g for gs in self._routes.values() for g in gs)

    def register(self, reg: Registration) -> bool:
        """Record a report from a server; True when it is a new registration, False for a heartbeat.

        A report from an address already known under another pid is a new registration: the
        process restarted.
        """
        now_ms = self._clock.now_ms()
        key = (reg.role, reg.group, reg.address)
        old = self._servers.get(key)
        if old is None and len(self._servers) >= SERVERS_MAX:
            raise RegistryFullError(
                f"the meta server already holds {SERVERS_MAX} servers; cannot register "
                f"{reg.role} {reg.address} of group {reg.group!r}"
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
        )
        # Store first: when the write fails, memory still says what the store says.
        self._store.save_server(record)
        self._servers[key] = record
        return is_new

    def groups(self, role: Role) -> list[GroupView]:
        """Every group of ``role`` that has a master, sorted by name."""
        masters: dict[str, ServerRecord] = {}
        for r in self._servers.values():
            if r.role != role or r.role_in_group != "master":
                continue
            best = masters.get(r.group)
            if best is None or r.last_heartbeat_ms > best.last_heartbeat_ms:
                masters[r.group] = r
        now_ms = self._clock.now_ms()
        return [
            GroupView(
                role=role,
                group=name,
                address=m.address,
                http=m.http,
                state="available"
                if now_ms - m.last_heartbeat_ms <= self._heartbeat_timeout_ms
                else "unavailable",
            )
            for name, m in sorted(masters.items())
        ]

    def routes(self, subjects: Iterable[str]) -> dict[str, list[str]]:
        """The broker groups of each subject (sorted), routing the ones not yet routed in full.

        A subject stays unrouted (an empty list) while no broker group is available.
        """
        available = [g.group for g in self.groups("broker") if g.state == "available"]
        return {s: self._route(s, available) for s in dict.fromkeys(subjects)}

    def _route(self, subject: str, available: list[str]) -> list[str]:
        current = self._routes.get(subject)
        if current is None:
            # Another meta server sharing the store may have routed it since we loaded.
            current = self._store.routes_of(subject)
        missing = self._route_groups - len(current)
        if missing > 0:
            have = set(current)
            candidates = sorted(
                (g for g in available if g not in have), key=lambda g: (self._subjects_per_group[g], g)
            )
            extra = candidates[:missing]
            if extra:
                if subject not in self._routes and len(self._routes) >= SUBJECTS_MAX:
                    raise RegistryFullError(
                        f"the meta server already routes {SUBJECTS_MAX} subjects; cannot route {subject!r}"
                    )
                routed = self._store.add_routes(subject, extra, self._clock.now_ms())
                self._subjects_per_group.update(g for g in routed if g not in have)
                current = routed
        if current:
            self._routes[subject] = current
        return list(current)

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
