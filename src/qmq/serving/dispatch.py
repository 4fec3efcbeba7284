"""Request dispatch shared by every role that serves frames: a table of request code → handler,
one ``requests`` counter per command, UNKNOWN_COMMAND for codes the role does not serve, and
the one mapping of a handler's failure to its answer:

    BadRequest     → BAD_REQUEST     (the request is wrong; its text names the field)
    DiskFullError  → DISK_FULL       (retriable elsewhere or later)
    OutOfFilesError → BUSY           (no file descriptor to spare: retriable shortly)
    StoreError     → INTERNAL_ERROR  (logged)
    any other      → INTERNAL_ERROR  "internal error: Type: text" (logged with its traceback)

A failure costs one request, never the server or the connection.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping

from prometheus_client import Counter

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.requests import BadRequest
from qmq.store.datadir import DiskFullError, OutOfFilesError, StoreError

log = logging.getLogger(__name__)

Handler = Callable[[Responder, Frame], None]


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
    elif isinstance(exc, StoreError):
        log.error("store error on %s: %s", RequestCode(frame.code).name, exc)
        status, text = Status.INTERNAL_ERROR, str(exc)
    else:
        log.error("%s failed", RequestCode(frame.code).name, exc_info=exc)
        status, text = Status.INTERNAL_ERROR, f"internal error: {type(exc).__name__}: {exc}"
    conn.respond(frame.code, frame.request_id, {"error": text}, status=status)
