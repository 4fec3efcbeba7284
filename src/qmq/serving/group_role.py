"""A server's role in its group (docs/cluster.md), shared by brokers and delay servers: the
epoch file of its data directory (the epoch it last served in and its role then), and turning
a meta server's heartbeat answer into a promotion, a newer epoch or following a master
(``GroupMember``). Replication itself is qmq.serving.replication."""

from __future__ import annotations

import asyncio
import json
import logging
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Literal, NamedTuple

from qmq.serving.replication import ReplicationSource, Replicator
from qmq.store import fileio

log = logging.getLogger(__name__)

EPOCH_FILE = "epoch"


class RoleChange(NamedTuple):
    """What a heartbeat answer orders: "promote" (this slave is master now), "epoch" (this master
    stays, in a newer epoch) or "follow" (be a slave of ``master``, cutting the logs to
    ``truncate`` first when given)."""

    kind: Literal["promote", "epoch", "follow"]
    epoch: int
    master: str | None = None
    truncate: dict[str, Any] | None = None


def role_change(answer: dict[str, Any], role: str, epoch: int, following: str | None, me: str) -> RoleChange | None:
    """The change of role a meta server's heartbeat answer orders a server of a group that is
    ``role`` in ``epoch`` (following ``following`` when a slave); None: stay as it is."""
    ordered = answer.get("role_in_group")
    new_epoch = answer.get("epoch")
    if ordered not in ("master", "slave") or not isinstance(new_epoch, int):
        return None  # a meta server that does not manage roles: stay as started
    master = answer.get("master")
    if ordered == "master":
        if role == "slave":
            return RoleChange("promote", new_epoch)
        return RoleChange("epoch", new_epoch) if new_epoch > epoch else None
    if isinstance(master, str) and master != me and (role == "master" or following != master):
        truncate = answer.get("truncate")
        return RoleChange("follow", new_epoch, master, truncate if isinstance(truncate, dict) else None)
    return None


def read_epoch(directory: Path) -> tuple[int, str | None]:
    """The epoch this server last served in and its role then (None in files that predate it)."""
    try:
        value = json.loads(fileio.read_text(directory / EPOCH_FILE))
    except (FileNotFoundError, ValueError):
        return 0, None
    if not isinstance(value, dict):
        return 0, None
    role = value.get("role")
    return int(value.get("epoch", 0)), role if isinstance(role, str) else None


def write_epoch(directory: Path, epoch: int, role: str) -> None:
    # fsynced before the rename: a power loss must not leave an empty epoch file, which reads
    # as epoch 0 and would let an old master believe it may write
    fileio.replace_file(directory / EPOCH_FILE, json.dumps({"epoch": epoch, "role": role}).encode())


class GroupMember(ABC):
    """What a server of a group with slaves (a broker, a delay server) does with the meta
    server's orders, shared: its role and epoch (kept in the epoch file of its data directory),
    and turning a heartbeat answer into a promotion, a newer epoch or following a master.
    The server supplies ``_promote`` and ``_follow`` (what each means for its store) and
    calls ``_take_orders`` from its heartbeat's answer."""

    role: str
    epoch: int
    source: ReplicationSource
    replicator: Replicator | None
    stopping: bool

    def _start_in_role(self, directory: Path, configured: str, title: str, group: str) -> None:
        """--role decides a first start only: a server that served in an epoch starts as what it
        was then, so a slave restarted with --role master never claims its group's epoch as its
        master (found by the fault campaign: the meta server took it for the master restarted,
        and the two copies diverged)."""
        self._epoch_dir = directory
        self.epoch, saved_role = read_epoch(directory)
        self.role = saved_role if self.epoch and saved_role in ("master", "slave") else configured
        self._saved_role = saved_role
        self._transition: asyncio.Task[None] | None = None
        if self.role != configured:
            log.warning(
                "this %s was a %s of group %s in epoch %d when it stopped: it starts as one (--role %s "
                "applies to a first start only)",
                *(title, self.role, group, self.epoch, configured),
            )

    def _take_orders(self, answer: dict[str, Any]) -> RoleChange | None:
        """Carry out what a heartbeat answer orders (a promotion or following runs as a task: one
        at a time, the next heartbeat says again); returns the change begun or made."""
        slaves = answer.get("slaves")
        self.source.slaves_reported = slaves if isinstance(slaves, int) else 0
        named = answer.get("slave_addresses")
        self.source.name_slaves([a for a in named if isinstance(a, str)] if isinstance(named, list) else None)
        if self._transition is not None and not self._transition.done():
            return None  # the last change is still being carried out; the next heartbeat says again
        following = None if self.replicator is None else self.replicator.master
        change = role_change(answer, self.role, self.epoch, following, self.address)
        if change is None:
            return None
        if change.kind == "promote":
            self._transition = asyncio.ensure_future(self._promote(change.epoch))
        elif change.kind == "epoch":
            self._set_epoch(change.epoch, "master")
        else:
            assert change.master is not None
            self._transition = asyncio.ensure_future(self._follow(change.master, change.epoch, change.truncate))
        return change

    async def _end_transition(self) -> None:
        if self._transition is not None:
            await asyncio.gather(self._transition, return_exceptions=True)

    def _set_epoch(self, epoch: int, role: str) -> None:
        if (epoch, role) != (self.epoch, self._saved_role):
            self.epoch, self._saved_role = epoch, role
            write_epoch(self._epoch_dir, epoch, role)

    async def _check_slaves(self) -> None:
        if self.role == "master":
            self.source.check()

    @property
    @abstractmethod
    def address(self) -> str:
        """The address this server advertises (its frame server's)."""

    @abstractmethod
    async def _promote(self, epoch: int) -> None:
        """Become the group's master in ``epoch``: what that means for this role's store."""

    @abstractmethod
    async def _follow(self, master: str, epoch: int, truncate: dict[str, Any] | None) -> None:
        """Follow ``master`` in ``epoch``, first cutting what ``truncate`` names."""
