"""What the meta server decides about a group, as pure functions of what it knows (docs/cluster.md).

No store, no clock, no I/O: the registry reads the group's row and its servers' rows, asks
here, and writes what comes back. So each rule is tested on plain values.

The rules for a server's report (``decide``):

- A group without a row gets one when a server reporting ``master`` arrives: it is the
  master, in epoch 1 (or the epoch it reports, if higher: the store was lost, the servers
  remember). A server reporting ``slave`` waits: slave, no master to follow.
- The master of the group's row is told it is master of the group's epoch, whatever it
  reports (a slave just promoted learns it this way).
- Another server reporting ``master`` takes the group's row over only when that cannot lose
  data: it reports the group's own epoch (the master restarted at another address), or a
  later epoch (the store is behind), or neither it nor the row's master reports epochs at all
  (servers of before epochs: the latest master wins, as it always did). Every other server
  is a slave of the row's master; one that worked in an older epoch is told to cut its logs
  where the next epoch began.

Promotion (``candidates``): a slave may become master when it heartbeats (within the
timeout), reports the group's epoch (it follows the current master, not an older one) and
was replicating at most ``heartbeat_timeout_ms`` before the master was last heard from. Of
several, the one with the longest message log wins (then action log, then the most recent
replication, then the address).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Final, Literal

from qmq.meta.store import GroupRecord, ServerRecord

Role = Literal["broker", "delay"]
RoleInGroup = Literal["master", "slave"]
WriteState = Literal["ok", "read-only", "degraded", "disk-full", "failed"]

ROLES: Final = ("broker", "delay")
ROLES_IN_GROUP: Final = ("master", "slave")
WRITE_STATES: Final = ("ok", "read-only", "degraded", "disk-full", "failed")


@dataclass(frozen=True, slots=True)
class Registration:
    """What a server reports about itself, first time and every heartbeat.

    ``epoch`` is None when the server does not report one (it predates epochs); the
    replication fields default to what a server without a log would report.
    """

    role: Role
    group: str
    address: str
    http: str
    pid: int
    role_in_group: RoleInGroup = "master"
    epoch: int | None = None
    log_end: int = 0
    action_end: int = 0
    replicated_ms: int = 0
    write_state: WriteState | None = None


@dataclass(frozen=True, slots=True)
class Decision:
    """The answer to one report, and the group row to store first (None: the row stays).

    ``cut_after_epoch``: the server must cut its logs where the epoch after this one began.
    """

    role_in_group: RoleInGroup
    group_after: GroupRecord | None
    cut_after_epoch: int | None = None


def decide(
    reg: Registration, group: GroupRecord | None, master: ServerRecord | None, *, now_ms: int, by: str
) -> Decision:
    """What ``reg``'s server must be, given the group's row and the last report of its master."""
    if group is None:
        if reg.role_in_group == "slave":
            return Decision("slave", None)
        first = GroupRecord(
            role=reg.role,
            group=reg.group,
            epoch=max(1, reg.epoch or 0),
            master=reg.address,
            message_offset=None,
            action_offset=None,
            changed_at_ms=now_ms,
            changed_by=by,
        )
        return Decision("master", first)
    if reg.address == group.master:
        if reg.role_in_group == "master" and reg.epoch is not None and reg.epoch > group.epoch:
            return Decision("master", replace(group, epoch=reg.epoch, changed_at_ms=now_ms, changed_by=by))
        return Decision("master", None)
    if reg.role_in_group == "master" and _may_take_over(reg, group, master):
        epoch = max(group.epoch, reg.epoch or 0)
        return Decision("master", replace(group, epoch=epoch, master=reg.address, changed_at_ms=now_ms, changed_by=by))
    cut = reg.epoch if reg.epoch is not None and 1 <= reg.epoch < group.epoch else None
    return Decision("slave", None, cut)


def _may_take_over(reg: Registration, group: GroupRecord, master: ServerRecord | None) -> bool:
    if reg.epoch is None:
        return master is None or master.epoch is None
    return reg.epoch >= group.epoch >= 1


def is_fresh(server: ServerRecord, now_ms: int, timeout_ms: int) -> bool:
    """Whether ``server`` heartbeats: its last report is at most ``timeout_ms`` old."""
    return now_ms - server.last_heartbeat_ms <= timeout_ms


def slaves_heartbeating(group: GroupRecord, servers: list[ServerRecord], now_ms: int, timeout_ms: int) -> int:
    """Servers of the group, other than its master, reporting ``slave`` and heartbeating."""
    return len(slave_addresses(group, servers, now_ms, timeout_ms))


def slave_addresses(group: GroupRecord, servers: list[ServerRecord], now_ms: int, timeout_ms: int) -> tuple[str, ...]:
    """The addresses of the slaves ``slaves_heartbeating`` counts, sorted."""
    return tuple(
        sorted(
            s.address
            for s in servers
            if s.address != group.master and s.role_in_group == "slave" and is_fresh(s, now_ms, timeout_ms)
        )
    )


def candidates(
    group: GroupRecord, servers: list[ServerRecord], master: ServerRecord | None, *, now_ms: int, timeout_ms: int
) -> tuple[list[ServerRecord], list[str]]:
    """The slaves ``group`` may promote, best first, and why each other server of the group may not."""
    heard_ms = now_ms if master is None else min(now_ms, master.last_heartbeat_ms)
    eligible: list[ServerRecord] = []
    reasons: list[str] = []
    for s in servers:
        if s.address == group.master:
            continue
        who = f"{s.address} (pid {s.pid})"
        if not is_fresh(s, now_ms, timeout_ms):
            reasons.append(f"{who} is silent for {(now_ms - s.last_heartbeat_ms) / 1000:.1f} s")
        elif s.role_in_group != "slave":
            reasons.append(f"{who} reports itself {s.role_in_group}, not slave")
        elif s.epoch != group.epoch:
            shown = "no epoch" if s.epoch is None else f"epoch {s.epoch}"
            reasons.append(f"{who} reports {shown}, the group is in epoch {group.epoch} (it has not caught up)")
        elif s.replicated_ms <= 0 or s.replicated_ms < heard_ms - timeout_ms:
            last = "never" if s.replicated_ms <= 0 else f"{(heard_ms - s.replicated_ms) / 1000:.1f} s"
            reasons.append(
                f"{who} last held every write its master had answered {last} before the master was last heard from "
                f"(the limit is heartbeat_timeout_ms = {timeout_ms} ms)"
            )
        else:
            eligible.append(s)
    eligible.sort(key=lambda s: (-s.log_end, -s.action_end, -s.replicated_ms, s.address))
    return eligible, reasons


def promoted(group: GroupRecord, slave: ServerRecord, *, now_ms: int, by: str) -> GroupRecord:
    """The group's row once ``slave`` is its master: the next epoch, begun at the slave's log ends."""
    return replace(
        group,
        epoch=group.epoch + 1,
        master=slave.address,
        message_offset=slave.log_end,
        action_offset=slave.action_end,
        changed_at_ms=now_ms,
        changed_by=by,
    )
