"""Replication between the brokers of a group (docs/cluster.md).

``ReplicationSource`` is the master's side: it answers slaves' REPLICATE requests (a long
poll woken when the logs grow), learns from each request how far the slave has written,
and releases the answers of sends and acks waiting for that (``wait_slave_wrote``). It also
says whether the group may take writes: with a slave that stopped replicating for
``slave_timeout_ms`` the group is read-only, or degraded to unreplicated writes when
``degrade_unreplicated`` is on. Each waiting answer runs through ``call_reply``, so one that
fails is logged and the others are released.

Anyone may send a REPLICATE, so only the slaves the meta server names in its heartbeat answers
(``name_slaves``) count: a client that claims to be a slave may read the log, but neither
releases writes nor, once it stops asking, turns the group read-only. Offsets past the end of
the master's logs are refused, never counted as replicated.

``Replicator`` is the slave's side: one loop asking its master for what follows its copy and
appending it (``store.replica``).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import deque
from collections.abc import Callable
from ssl import SSLContext
from typing import Literal

from qmq.auth.handshake import ClientCredentials
from qmq.client.connection import Connection
from qmq.common.config import BrokerConfig
from qmq.common.errors import BrokerError, ConnectionLostError, QmqError
from qmq.protocol.codes import RequestCode, Status
from qmq.serving.connection import Responder
from qmq.serving.replies import Reply, call_reply
from qmq.store.broker_store import BrokerStore
from qmq.store.replica import Chunk, ReplicaError, append_actions, append_log, read_actions, read_log

log = logging.getLogger(__name__)

WriteState = Literal["alone", "replicated", "degraded", "read-only"]

_CHUNK_BYTES_MAX = 4 * 1024 * 1024
_PARKED_MAX = 64
# requesters not (yet) named by the meta server kept with their last offsets, so a slave that asked
# before its master heard of it counts at once when it is named; the oldest is dropped first
_UNNAMED_MAX = 64
_UNNAMED_PARKED_MAX = _PARKED_MAX // 4
_NAMED_MAX = 64
_WAITERS_MAX = 100_000
_REPLICATE_POLL_MS = 1000
_CONNECT_TIMEOUT_MS = 3000
_RETRY_S_MIN = 0.05
_RETRY_S_MAX = 2.0


class ReplicationSource:
    def __init__(self, store_of: Callable[[], BrokerStore], config: BrokerConfig) -> None:
        self.store_of = store_of
        self.config = config
        self.slaves_reported = 0  # slaves heartbeating, from the meta server's last answer
        # the named slaves that asked: address -> (log offset, action offset, when)
        self.slaves: dict[str, tuple[int, int, float]] = {}
        # slaves the meta server named in this epoch, least recently named first (kept when it later
        # forgets one: a slave that died still makes the group read-only; past _NAMED_MAX the least
        # recently named goes); None: a meta server that names none, every requester counts
        self.named: dict[str, None] | None = {}
        self._unnamed: dict[str, tuple[int, int, float]] = {}
        self.replicated = 0  # message-log offset some slave has written
        self.actions_replicated = 0
        self.started = time.monotonic()
        self._log_waiters: deque[tuple[int, Reply]] = deque()
        self._action_waiters: deque[tuple[int, Reply]] = deque()
        # long polls waiting for the logs to grow, and the slave each is from
        self._parked: list[tuple[Responder, int, int, dict[str, int], asyncio.TimerHandle, str]] = []
        self._wake_scheduled = False

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

    def after_log_replicated(self, end: int, reply: Reply) -> None:
        """Call ``reply`` once a slave has written the message log up to ``end`` (or at once, alone)."""
        state = self.write_state()
        if state in ("alone", "degraded") or self.replicated >= end:
            call_reply(reply, None)
        elif state == "read-only":
            call_reply(reply, self.read_only_text())
        elif len(self._log_waiters) >= _WAITERS_MAX:
            call_reply(reply, "too many writes are waiting for the slave; retry shortly")
        else:
            self._log_waiters.append((end, reply))

    def after_actions_replicated(self, end: int, reply: Reply) -> None:
        """Call ``reply(None)`` once a slave has the action log up to ``end`` (or at once, alone or
        degraded), or ``reply(text)`` when it will not get there soon: an ack is then recorded on
        the master but not answered as done, so the client sends it again (acks repeat safely)
        and an answered ack always survives a failover."""
        state = self.write_state()
        if state in ("alone", "degraded") or self.actions_replicated >= end:
            call_reply(reply, None)
        elif state == "read-only":
            call_reply(reply, self.read_only_text())
        elif len(self._action_waiters) >= _WAITERS_MAX:
            call_reply(reply, "too many acks are waiting for the slave; they are sent again shortly")
        else:
            self._action_waiters.append((end, reply))

    def read_only_text(self) -> str:
        return (
            f"group {self.config.group} is read-only: its slave has not replicated for more than "
            f"slave_timeout_ms={self.config.slave_timeout_ms}; send to another broker group "
            "(set degrade_unreplicated to keep writing on the master alone)"
        )

    def check(self) -> None:
        """Fail waiting writes once the group turned read-only (called on a timer)."""
        if self.write_state() == "read-only" and self._log_waiters:
            text = self.read_only_text()
            while self._log_waiters:
                call_reply(self._log_waiters.popleft()[1], text)
            while self._action_waiters:
                call_reply(self._action_waiters.popleft()[1], text)

    def fail_all(self, text: str) -> None:
        while self._log_waiters:
            call_reply(self._log_waiters.popleft()[1], text)
        while self._action_waiters:
            call_reply(self._action_waiters.popleft()[1], text)
        for conn, code, request_id, _h, timer, _slave in self._parked:
            timer.cancel()
            conn.respond(code, request_id, {"error": text}, status=Status.NOT_MASTER)
        self._parked.clear()

    # -- REPLICATE requests --------------------------------------------------------------

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

    def request(self, conn: Responder, code: int, request_id: int, header: dict[str, int], slave: str) -> None:
        """A slave asks for what follows its copy; ``header`` holds from / action_from / max_bytes / timeout_ms."""
        store = self.store_of()
        log_end, action_end = store.mlog.end, store.alog.end
        if header["from"] > log_end or header["action_from"] > action_end:
            # never counted: offsets past the end would release writes no slave has
            conn.respond(
                code,
                request_id,
                {
                    "error": f"cannot replicate: asked for message-log offset {header['from']} and action-log "
                    f"offset {header['action_from']}, past the end of this master's logs ({log_end}, "
                    f"{action_end}): the copies diverged"
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

    def _answer(self, conn: Responder, code: int, request_id: int, header: dict[str, int], wait: bool) -> bool:
        """Send what is there; True when there was nothing and the request should wait."""
        store = self.store_of()
        budget = min(int(header.get("max_bytes", _CHUNK_BYTES_MAX)), _CHUNK_BYTES_MAX)
        try:
            log_chunk = read_log(store, header["from"], budget)
            act_chunk = read_actions(store, header["action_from"], budget)
        except ReplicaError as exc:
            conn.respond(code, request_id, {"error": f"cannot replicate: {exc}"}, status=Status.BAD_REQUEST)
            return False
        except OSError as exc:  # a failing disk: the slave asks again (never raise out of a wake-up)
            conn.respond(code, request_id, {"error": f"reading the log to replicate failed: {exc}"}, status=Status.BUSY)
            return False
        if wait and not log_chunk.data and not act_chunk.data:
            return True
        conn.respond(
            code,
            request_id,
            {
                "offset": log_chunk.offset,
                "segment_base": log_chunk.segment_base,
                "count": len(log_chunk.data),
                "action_offset": act_chunk.offset,
                "action_segment_base": act_chunk.segment_base,
                "action_count": len(act_chunk.data),
            },
            [c for c in (log_chunk.data, act_chunk.data) if c],
        )
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


class Replicator:
    """The slave's loop: copy the master's logs, then ask again (the request's ``from`` is the ack)."""

    def __init__(
        self,
        store_of: Callable[[], BrokerStore],
        master: str,
        epoch: int,
        me: str,
        on_data: Callable[[set[str]], None],
        credentials: ClientCredentials | None = None,
        ssl: SSLContext | None = None,
    ) -> None:
        self.store_of = store_of
        self.credentials = credentials
        self.ssl = ssl
        self.master = master
        self.epoch = epoch
        self.me = me
        self.on_data = on_data
        self.last_ms = 0
        self.failed: str | None = None
        self._task: asyncio.Task[None] | None = None
        self._conn: Connection | None = None

    def start(self) -> None:
        self._conn = Connection(
            self.master, connect_timeout_ms=_CONNECT_TIMEOUT_MS, credentials=self.credentials, ssl=self.ssl
        )
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        assert self._conn is not None
        retry_s = _RETRY_S_MIN
        while True:
            store = self.store_of()
            header = {
                "from": store.mlog.end,
                "action_from": store.alog.end,
                "epoch": self.epoch,
                "max_bytes": _CHUNK_BYTES_MAX,
                "timeout_ms": _REPLICATE_POLL_MS,
                "slave": self.me,
            }
            try:
                frame = await self._conn.request(RequestCode.REPLICATE, header)
                h = frame.header
                body = bytes(frame.body)
                n = int(h["count"])
                touched = append_log(store, Chunk(int(h["offset"]), int(h["segment_base"]), body[:n]))
                append_actions(store, Chunk(int(h["action_offset"]), int(h["action_segment_base"]), body[n:]))
                self.last_ms = time.time_ns() // 1_000_000
                retry_s = _RETRY_S_MIN
                if touched:
                    self.on_data(touched)
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
        if self._conn is not None:
            await self._conn.close()
