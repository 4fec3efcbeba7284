"""Request dispatch shared by every role that serves frames: a table of request code → handler,
one ``requests`` counter per command, UNKNOWN_COMMAND for codes the role does not serve, and
the one mapping of a handler's failure to its answer:

    BadRequest     → BAD_REQUEST     (the request is wrong; its text names the field)
    DiskFullError  → DISK_FULL       (retriable elsewhere or later)
    OutOfFilesError → BUSY           (no file descriptor to spare: retriable shortly)
    StoreFailedError → BUSY          (the store failed before the request wrote anything: ask
                                     again, of the restarted broker or its promoted slave)
    StoreError     → INTERNAL_ERROR  (logged)
    any other      → INTERNAL_ERROR  "internal error: Type: text" (logged with its traceback)

A failure costs one request, never the server or the connection.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar, Protocol, TypeVar

from prometheus_client import Counter

from qmq.auth.permissions import Action, Grants
from qmq.common.clock import Clock
from qmq.common.limits import Limits
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.protocol.message import ScannedMessage
from qmq.serving.connection import Responder
from qmq.serving.disk import FreeSpace
from qmq.serving.requests import BadRequest, scan_send
from qmq.store.datadir import DiskFullError, OutOfFilesError, StoreError, StoreFailedError

if TYPE_CHECKING:  # group_commit answers through replies, which answers failures through here
    from qmq.serving.group_commit import GroupCommit

log = logging.getLogger(__name__)

Handler = Callable[[Responder, Frame], None]
T = TypeVar("T")


class RequestTable:
    """``dispatch`` runs the handler of a frame's code and answers its failure by kind.

    ``requests`` is a counter labelled by command name; ``unknown`` gives the error text for a
    code the table lacks (a role says what it serves instead).
    """

    def __init__(
        self,
        handlers: Mapping[int, Handler],
        requests: Counter,
        unknown: Callable[[int], str],
    ) -> None:
        self.handlers: dict[int, Handler] = dict(handlers)
        self.requests = requests
        self.unknown = unknown
        # the counter of each command, made on its first request (a command never asked for
        # has no series, as with ``labels()`` per request) and then one dict look-up per frame
        self._counted: dict[int, Counter] = {}

    def dispatch(self, conn: Responder, frame: Frame) -> None:
        code = frame.code
        handler = self.handlers.get(code)
        if handler is None:
            conn.respond(code, frame.request_id, {"error": self.unknown(code)}, status=Status.UNKNOWN_COMMAND)
            return
        counted = self._counted.get(code)
        if counted is None:
            counted = self._counted[code] = self.requests.labels(RequestCode(code).name)
        counted.inc()
        try:
            handler(conn, frame)
        except Exception as exc:  # a bug or a disk error must cost one request, not the server
            answer_failure(conn, frame, exc)


def answer_failure(conn: Responder, frame: Frame, exc: Exception) -> None:
    """Answer ``frame`` with the status and text of what its handler raised (module docstring)."""
    if isinstance(exc, BadRequest):
        status, text = Status.BAD_REQUEST, str(exc)
    elif isinstance(exc, DiskFullError):
        status, text = Status.DISK_FULL, str(exc)
    elif isinstance(exc, OutOfFilesError):
        log.warning("%s: %s", RequestCode(frame.code).name, exc)
        status, text = Status.BUSY, f"{exc}; retry shortly"
    elif isinstance(exc, StoreFailedError):  # refused before writing: the request may go again
        log.warning("%s refused: %s", RequestCode(frame.code).name, exc)
        status, text = Status.BUSY, f"{exc}; ask again (this group's next master takes it)"
    elif isinstance(exc, StoreError):
        log.error("store error on %s: %s", RequestCode(frame.code).name, exc)
        status, text = Status.INTERNAL_ERROR, str(exc)
    else:
        log.error("%s failed", RequestCode(frame.code).name, exc_info=exc)
        status, text = Status.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}"
    conn.respond(frame.code, frame.request_id, {"error": text}, status=status)


class _RoleConfig(Protocol):
    @property
    def group(self) -> str: ...
    @property
    def disk_free_bytes_min(self) -> int: ...


class _DataDir(Protocol):
    @property
    def dir(self) -> Path: ...


class RoleContext(Protocol):
    """What ``RoleHandlers`` reads of a role (a broker's or delay server's context is one)."""

    @property
    def config(self) -> _RoleConfig: ...
    @property
    def clock(self) -> Clock: ...
    @property
    def limits(self) -> Limits: ...
    @property
    def store(self) -> _DataDir: ...
    @property
    def flusher(self) -> GroupCommit: ...
    @property
    def stopping(self) -> bool: ...


class RoleHandlers(ABC):
    """What the handlers of every frame-serving role share: PING, the limits, the free-space
    check of the data directory a send consults, and the request table (PING included)
    ``dispatch`` runs. A role's ``Handlers`` adds its commands with ``serve``."""

    kind: ClassVar[str]  # "broker", "delay": what PING answers as the role

    def __init__(self, ctx: RoleContext) -> None:
        self.limits = ctx.limits
        self.free_space = FreeSpace(ctx.store.dir, ctx.config.disk_free_bytes_min)
        self._group = ctx.config.group
        self._clock = ctx.clock
        # set by a server with an auth file: answers a send to a subject its app may not produce to
        self.deny: Callable[[Responder, Frame, Action, str | None], None] | None = None
        # and answers a send over its app's quota THROTTLED (True when it did)
        self.over_quota: Callable[[Responder, Frame, list[ScannedMessage]], bool] | None = None

    def serve(self, handlers: Mapping[int, Handler], requests: Counter, unknown: Callable[[int], str]) -> None:
        self.requests = RequestTable({RequestCode.PING: self.ping, **handlers}, requests, unknown)
        self.dispatch = self.requests.dispatch

    def ping(self, conn: Responder, frame: Frame) -> None:
        header = {"role": self.kind, "group": self._group, "time_ms": self._clock.now_ms()}
        conn.respond(frame.code, frame.request_id, header)

    @abstractmethod
    def refusal(self) -> tuple[Status, str] | None:
        """Why the role takes no send now, as (status, text); None when it takes one."""

    def take_send(self, conn: Responder, frame: Frame) -> tuple[bytes, list[ScannedMessage], dict[int, str]] | None:
        """A SEND_MESSAGES frame's body, its messages and, by index, those to refuse (see
        ``scan_send``); None when the role refuses the whole frame now (answered here)."""
        refusal = self.refusal()
        if refusal is not None:
            conn.respond(frame.code, frame.request_id, {"error": refusal[1]}, status=refusal[0])
            return None
        body = bytes(frame.body)
        scanned, problems = scan_send(body, self.limits)
        grants: Grants | None = getattr(conn, "grants", None)
        if grants is not None and self.deny is not None:
            for raw in {m.subject for m in scanned}:
                subject = raw.decode("utf-8", "replace")
                if not grants.allows(Action.PRODUCE, subject):
                    self.deny(conn, frame, Action.PRODUCE, subject)
                    return None
            if self.over_quota is not None and self.over_quota(conn, frame, scanned):
                return None
        return body, scanned, problems

    def storing(self, append: Callable[[], T]) -> T:
        """``append()``; a full disk met on the way refuses later sends at once until space returns."""
        try:
            return append()
        except DiskFullError as exc:
            self.free_space.met_full(str(exc))
            raise
