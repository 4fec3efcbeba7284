"""Replication between the servers of a group, whatever their role (docs/cluster.md): a broker
group copies its message log and action log, a delay group its write-ahead log and what its
schedule logs say was handed over. What is read and appended is the role's; the rest is here.

``ReplicationSource`` is the master's side: it answers slaves' REPLICATE requests (a long
poll woken when the logs grow), learns from each request how far the slave has written,
and releases the answers of writes waiting for that (``wait_slave_wrote``). It also says
whether the group may take writes: with a slave that stopped replicating for
``slave_timeout_ms`` the group is read-only, or degraded to unreplicated writes when
``degrade_unreplicated`` is on. Each waiting answer runs through ``call_reply``, so one that
fails is logged and the others are released. What an answer holds comes from the role's
``read``: the answer's fields and body parts, and whether it holds anything (a request that
would get nothing waits).

Anyone may send a REPLICATE, so only the slaves the meta server names in its heartbeat answers
(``name_slaves``) count: a client that claims to be a slave may read the log, but neither
releases writes nor, once it stops asking, turns the group read-only. Offsets past the end of
the master's logs (the role's ``ends``) are refused, never counted as replicated.

``Replicator`` is the slave's side: one loop asking its master for what follows its copy (the
role's ``ask`` says from where: the request is also the acknowledgement) and appending what
comes (the role's ``take``), with a bounded back-off after a failure.

No import of the SDK: the slave's connection to its master is the role's (an SDK ``Connection``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any, Literal, Protocol

from qmq.common.errors import BrokerError, ConnectionLostError, QmqError
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.replies import Reply, call_reply
from qmq.serving.requests import get_int, get_str
from qmq.store.replica import ReplicaError

log = logging.getLogger(__name__)

WriteState = Literal["alone", "replicated", "degraded", "read-only"]

CHUNK_BYTES_MAX = 4 * 1024 * 1024
_PARKED_MAX = 64
# requesters not (yet) named by the meta server kept with their last offsets, so a slave that asked
# before its master heard of it counts at once when it is named; the oldest is dropped first
_UNNAMED_MAX = 64
_UNNAMED_PARKED_MAX = _PARKED_MAX // 4
_NAMED_MAX = 64
_WAITERS_MAX = 100_000
REPLICATE_POLL_MS = 1000
_RETRY_S_MIN = 0.05
_RETRY_S_MAX = 2.0

# What a REPLICATE request asks for: fields the role reads, by name (``from`` and ``action_from``
# are the two logs' offsets the slave has written, so also how far it got).
Read = Callable[[dict[str, Any]], tuple[dict[str, Any], list[bytes], bool]]


class MasterConnection(Protocol):
    """A slave's connection to its master (the SDK's ``Connection`` is one)."""

    async def request(self, code: int, header: dict[str, Any]) -> Frame: ...
    async def close(self) -> None: ...


class ReplicationSettings(Protocol):
    """The fields of a role's configuration replication reads."""

    @property
    def group(self) -> str: ...
    @property
    def wait_slave_wrote(self) -> bool: ...
    @property
    def slave_timeout_ms(self) -> int: ...
    @property
    def degrade_unreplicated(self) -> bool: ...


class ReplicationSource:
    def __init__(
        self,
        read: Read,
        config: ReplicationSettings,
        ends: Callable[[], tuple[int, int]],
        what: str = "group",
    ) -> None:
        self.read = read
        self.config = config
        self.ends = ends  # where the master's two logs end now
        self.what = what  # "group" or "delay group", for the texts a producer reads
        self.slaves_reported = 0  # slaves heartbeating, from the meta server's last answer
        # the named slaves that asked: address -> (log offset, action offset, when)
        self.slaves: dict[str, tuple[int, int, float]] = {}
        # slaves the meta server named in this epoch, least recently named first (kept when it later
        # forgets one: a slave that died still makes the group read-only; past _NAMED_MAX the least
        # recently named goes); None: a meta server that names none, every requester counts
        self.named: dict[str, None] | None = {}
        self._unnamed: dict[str, tuple[int, int, float]] = {}
        self.replicated = 0  # first-log offset some slave has written
        self.actions_replicated = 0
        self.started = time.monotonic()
        self._log_waiters: deque[tuple[int, Reply]] = deque()
        self._action_waiters: deque[tuple[int, Reply]] = deque()
        # long polls waiting for the logs to grow, and the slave each is from
        self._parked: list[tuple[Responder, int, int, dict[str, Any], asyncio.TimerHandle, str]] = []
        self._wake_scheduled = False
        # set by fail_all (no longer master, or stopping) until reset (master again): a write
        # whose fsync completes after that is answered with this text, never left waiting for
        # a slave that no longer copies from here, nor answered as done by an ex-master
        self._refusing: str | None = None
        # where each log (message or write-ahead log, action log) must at least reach in a slave's
        # copy before it holds every write this master answered: its logs as they were when it
        # began as master (or first looked: what it held may have been answered by no slave), then
        # the ends of writes answered without a slave's copy (alone, degraded). A slave short of
        # either is catching up, not caught up: REPLICATE answers say so (``caught_up_at``) and the
        # slave reports no fresh replicated_ms meanwhile, so the meta server never promotes it over
        # writes that would then be lost (found by bench.delay_failover under load).
        self._must_reach: list[int] | None = None

    # -- the group's write state ---------------------------------------------------------

    def write_state(self) -> WriteState:
        cfg = self.config
        now = time.monotonic()
        last = max((when for _o, _a, when in self.slaves.values()), default=self.started)
        fresh = now - last <= cfg.slave_timeout_ms / 1000
        if not cfg.wait_slave_wrote or (self.slaves_reported == 0 and not self.slaves):
            return "alone"
        if fresh:
            return "replicated"
        return "degraded" if cfg.degrade_unreplicated else "read-only"

    def name_slaves(self, addresses: list[str] | None) -> None:
        """The slaves of the group, as the meta server's heartbeat answer names them (None: it names
        none, an older meta server: every requester counts, as before)."""
        if addresses is None:
            self.named = None
        elif self.named is not None:
            for address in addresses[:_NAMED_MAX]:
                self.named.pop(address, None)
                self.named[address] = None
            while len(self.named) > _NAMED_MAX:  # slaves restarted on new ports, long gone
                gone = next(iter(self.named))
                del self.named[gone]
                self.slaves.pop(gone, None)
        for address in [a for a in self._unnamed if self._counts(a)]:
            log_offset, action_offset, when = self._unnamed.pop(address)
            self._count(address, log_offset, action_offset, when)

    def reset(self, log_end: int, action_end: int) -> None:
        """A new epoch as master: no slave has asked yet; what is in the logs counts as replicated."""
        self.started = time.monotonic()
        self.slaves.clear()
        self._unnamed.clear()
        if self.named is not None:
            self.named = {}
        self.replicated = log_end
        self.actions_replicated = action_end
        self._refusing = None
        self._must_reach = [log_end, action_end]

    def must_reach(self) -> list[int]:
        """Where a slave's copy of each log must reach to hold every write answered here."""
        if self._must_reach is None:
            self._must_reach = list(self.ends())
        return self._must_reach

    def _answered_alone(self, kind: int, end: int) -> None:
        reach = self.must_reach()
        reach[kind] = max(reach[kind], end)

    def lowest_kept(self, within_s: float) -> int | None:
        """The lowest first-log offset written by a slave seen in the last ``within_s`` seconds
        (None: none): what a master deleting old log segments keeps for it."""
        since = time.monotonic() - within_s
        return min((o for o, _a, when in self.slaves.values() if when >= since), default=None)

    def after_log_replicated(self, end: int, reply: Reply) -> None:
        """Call ``reply`` once a slave has written the first log up to ``end`` (or at once, alone)."""
        self._after(0, end, reply, "writes")

    def after_actions_replicated(self, end: int, reply: Reply) -> None:
        """Call ``reply(None)`` once a slave has the action log up to ``end`` (or at once, alone or
        degraded), or ``reply(text)`` when it will not get there soon: an ack is then recorded on
        the master but not answered as done, so the client sends it again (acks repeat safely)
        and an answered ack always survives a failover."""
        self._after(1, end, reply, "acks")

    def _after(self, kind: int, end: int, reply: Reply, what: str) -> None:
        waiters = self._action_waiters if kind else self._log_waiters
        replicated = self.actions_replicated if kind else self.replicated
        if self._refusing is not None:
            call_reply(reply, self._refusing)
            return
        state = self.write_state()
        if replicated >= end:
            call_reply(reply, None)
        elif state in ("alone", "degraded"):
            self._answered_alone(kind, end)
            call_reply(reply, None)
        elif state == "read-only":
            call_reply(reply, self.read_only_text())
        elif len(waiters) >= _WAITERS_MAX:
            call_reply(reply, f"too many {what} are waiting for the slave; retry shortly")
        else:
            waiters.append((end, reply))

    def read_only_text(self) -> str:
        return (
            f"{self.what} {self.config.group} is read-only: its slave has not replicated for more than "
            f"slave_timeout_ms={self.config.slave_timeout_ms}; send to another {self.what} "
            "(set degrade_unreplicated to keep writing on the master alone)"
        )

    def check(self) -> None:
        """Fail waiting writes once the group turned read-only, or answer them once it degraded to
        unreplicated writes (called on a timer): a write waiting for a slave that went away
        before the group degraded is answered as later ones are, not left waiting for good."""
        if not (self._log_waiters or self._action_waiters):
            return
        state = self.write_state()
        if state == "read-only":
            self._fail_waiters(self.read_only_text())
        elif state == "degraded":
            for kind, waiters in enumerate((self._log_waiters, self._action_waiters)):
                while waiters:
                    end, reply = waiters.popleft()
                    self._answered_alone(kind, end)
                    call_reply(reply, None)

    def _fail_waiters(self, text: str) -> None:
        while self._log_waiters:
            call_reply(self._log_waiters.popleft()[1], text)
        while self._action_waiters:
            call_reply(self._action_waiters.popleft()[1], text)

    def fail_all(self, text: str) -> None:
        """No longer master (or stopping): answer every waiting write and parked slave request with
        ``text``, and every write that comes to wait from now on, until ``reset``."""
        self._refusing = text
        self._fail_waiters(text)
        for conn, code, request_id, _h, timer, _slave in self._parked:
            timer.cancel()
            conn.respond(code, request_id, {"error": text}, status=Status.NOT_MASTER)
        self._parked.clear()

    # -- REPLICATE requests --------------------------------------------------------------

    def request(self, conn: Responder, code: int, request_id: int, header: dict[str, Any], slave: str) -> None:
        """A slave asks for what follows its copy; ``header`` holds from / action_from / max_bytes /
        timeout_ms, and whatever else the role's ``read`` takes."""
        log_end, action_end = self.ends()
        if header["from"] > log_end or header["action_from"] > action_end:
            # never counted: offsets past the end would release writes no slave has
            conn.respond(
                code,
                request_id,
                {
                    "error": f"cannot replicate: asked for offsets {header['from']} and {header['action_from']}, "
                    f"past the end of this master's logs ({log_end}, {action_end}): the copies diverged"
                },
                status=Status.BAD_REQUEST,
            )
            return
        self._seen(slave, header["from"], header["action_from"])
        if not self._answer(conn, code, request_id, header, wait=header["timeout_ms"] > 0):
            return
        if len(self._parked) >= _PARKED_MAX or (
            not self._counts(slave) and self._unnamed_parked() >= _UNNAMED_PARKED_MAX
        ):
            # full: answered at once (empty), the slave asks again; requesters the meta server has
            # not named may take only some of the places, so they never crowd the group's slaves out
            self._answer(conn, code, request_id, header, wait=False)
            return
        timer = asyncio.get_running_loop().call_later(header["timeout_ms"] / 1000, self._expire, conn, code, request_id)
        self._parked.append((conn, code, request_id, header, timer, slave))

    def _unnamed_parked(self) -> int:
        return sum(1 for p in self._parked if not self._counts(p[5]))

    def _counts(self, slave: str) -> bool:
        return self.named is None or slave in self.named

    def _seen(self, slave: str, log_offset: int, action_offset: int) -> None:
        now = time.monotonic()
        if self._counts(slave):
            self._count(slave, log_offset, action_offset, now)
            return
        self._unnamed.pop(slave, None)
        if len(self._unnamed) >= _UNNAMED_MAX:
            del self._unnamed[next(iter(self._unnamed))]
        self._unnamed[slave] = (log_offset, action_offset, now)

    def _count(self, slave: str, log_offset: int, action_offset: int, when: float) -> None:
        self.slaves[slave] = (log_offset, action_offset, when)
        self.replicated = max(self.replicated, log_offset)
        self.actions_replicated = max(self.actions_replicated, action_offset)
        while self._log_waiters and self._log_waiters[0][0] <= self.replicated:
            call_reply(self._log_waiters.popleft()[1], None)
        while self._action_waiters and self._action_waiters[0][0] <= self.actions_replicated:
            call_reply(self._action_waiters.popleft()[1], None)

    def _answer(self, conn: Responder, code: int, request_id: int, header: dict[str, Any], wait: bool) -> bool:
        """Send what is there; True when there was nothing and the request should wait."""
        try:
            fields, parts, has_data = self.read(header)
        except ReplicaError as exc:
            conn.respond(code, request_id, {"error": f"cannot replicate: {exc}"}, status=Status.BAD_REQUEST)
            return False
        except OSError as exc:  # a failing disk: the slave asks again (never raise out of a wake-up)
            conn.respond(code, request_id, {"error": f"reading the log to replicate failed: {exc}"}, status=Status.BUSY)
            return False
        if wait and not has_data:
            return True
        fields["caught_up_at"] = list(self.must_reach())
        conn.respond(code, request_id, fields, parts)
        return False

    def _expire(self, conn: Responder, code: int, request_id: int) -> None:
        for i, (c, _code, rid, header, _timer, _slave) in enumerate(self._parked):
            if c is conn and rid == request_id:
                del self._parked[i]
                self._answer(conn, code, request_id, header, wait=False)
                return

    def grew(self) -> None:
        """The logs grew: answer waiting slaves (once per loop turn, however many writes)."""
        if self._parked and not self._wake_scheduled:
            self._wake_scheduled = True
            asyncio.get_running_loop().call_soon(self._wake)

    def _wake(self) -> None:
        self._wake_scheduled = False
        parked, self._parked = self._parked, []
        for conn, code, request_id, header, timer, slave in parked:
            if self._answer(conn, code, request_id, header, wait=True):
                self._parked.append((conn, code, request_id, header, timer, slave))
            else:
                timer.cancel()

    def forget(self, conn: object) -> None:
        for entry in [p for p in self._parked if p[0] is conn]:
            entry[4].cancel()
            self._parked.remove(entry)


def take_request(
    source: ReplicationSource,
    epoch: int,
    conn: Responder,
    frame: Frame,
    timeout_ms_max: int,
    passed: tuple[str, ...] = (),
) -> None:
    """A REPLICATE request to a master in ``epoch``: NOT_MASTER when the slave asks in another
    epoch (it follows an older or newer master); else checked and handed to ``source``, with
    the role's own fields ``passed`` as they came (the role's ``read`` checks them)."""
    header = frame.header
    asked = get_int(header, "epoch", 0, 1 << 62)
    if asked != epoch:
        conn.respond(
            frame.code,
            frame.request_id,
            {"error": f"epoch {asked} is not this master's ({epoch}); ask the meta server for the master"},
            status=Status.NOT_MASTER,
        )
        return
    fields: dict[str, Any] = {
        "from": get_int(header, "from", 0, 1 << 62),
        "action_from": get_int(header, "action_from", 0, 1 << 62),
        "max_bytes": get_int(header, "max_bytes", 1024, 1 << 30),
        "timeout_ms": get_int(header, "timeout_ms", 0, timeout_ms_max, default=0),
    }
    for name in passed:
        fields[name] = header.get(name)
    source.request(conn, frame.code, frame.request_id, fields, get_str(header, "slave"))


def caught_up(answer: dict[str, Any], copy: dict[str, Any]) -> bool:
    """Whether a slave whose copy ends where ``copy`` says (its next request's from / action_from)
    holds every write its master had answered when it sent ``answer`` (its ``caught_up_at``; a
    master that does not say: yes, as before)."""
    reach = answer.get("caught_up_at")
    if not isinstance(reach, list) or len(reach) != 2:
        return True
    log_reach, action_reach = reach
    return (
        isinstance(log_reach, int)
        and isinstance(action_reach, int)
        and copy.get("from", 0) >= log_reach
        and copy.get("action_from", 0) >= action_reach
    )


class Replicator:
    """The slave's loop: copy the master's logs, then ask again (the request's ``from`` is the ack).

    ``conn`` carries REPLICATE requests to the master; ``ask()`` says where this copy ends (the
    header's from / action_from and the role's own fields); ``take(frame)`` appends an answer
    (ReplicaError when the copies diverged: the loop stops, an operator must look), and may
    return something to await before the next request (a delay slave swapping in a copy of its
    master's schedule: qmq.delay.resync)."""

    def __init__(
        self,
        master: str,
        epoch: int,
        me: str,
        conn: MasterConnection,
        ask: Callable[[], dict[str, Any]],
        take: Callable[[Frame], Awaitable[None] | None],
    ) -> None:
        self.master = master
        self.epoch = epoch
        self.me = me
        self._conn = conn
        self._ask = ask
        self._take = take
        self.last_ms = 0
        self.failed: str | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        retry_s = _RETRY_S_MIN
        while True:
            header = {
                **self._ask(),
                "epoch": self.epoch,
                "max_bytes": CHUNK_BYTES_MAX,
                "timeout_ms": REPLICATE_POLL_MS,
                "slave": self.me,
            }
            try:
                frame = await self._conn.request(RequestCode.REPLICATE, header)
                pending = self._take(frame)
                if pending is not None:
                    await pending
                if caught_up(frame.header, self._ask()):
                    self.last_ms = time.time_ns() // 1_000_000
                else:
                    # the master answered writes alone (or degraded) that this copy lacks: it is
                    # not to be promoted over them, however recently it was caught up before
                    self.last_ms = 0
                retry_s = _RETRY_S_MIN
            except asyncio.CancelledError:
                raise
            except ReplicaError as exc:
                # the copies diverged: following further would make it worse; an operator must look
                self.failed = str(exc)
                log.critical("replication from %s stopped: %s", self.master, exc)
                return
            except (BrokerError, ConnectionLostError, QmqError, OSError) as exc:
                log.warning("replicating from master %s failed: %s; retrying", self.master, exc)
                await asyncio.sleep(retry_s)  # bounded back-off before asking again
                retry_s = min(_RETRY_S_MAX, retry_s * 2)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self._conn.close()
