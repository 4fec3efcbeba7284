"""Answers given after their handler returned: a send answered once its fsync returns, an ack
once the slave has it, a long poll once messages come.

Such a reply runs in a loop that answers many requests (a group commit's flush, the
replication source's waiters, the parked pulls), outside the guard ``RequestTable.dispatch``
puts around a handler. So each reply is isolated twice: ``guarded`` makes a handler's reply
answer its own request INTERNAL_ERROR when it fails (as dispatch would have), and the loops
call every reply through ``call_reply``, which logs a failure and goes on, so one bad reply
never stops the others or the loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import ParamSpec

from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.dispatch import answer_failure

log = logging.getLogger(__name__)

# called with None once the write is durable (or replicated), or with the reason it never will be
Reply = Callable[[str | None], None]

P = ParamSpec("P")


def guarded(conn: Responder, code: int, request_id: int, reply: Callable[P, None]) -> Callable[P, None]:
    """``reply``, answering its request as a handler's failure (``answer_failure``) when it raises."""

    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        try:
            reply(*args, **kwargs)
        except Exception as exc:  # a bug, or an answer that cannot be encoded: fails this request only
            answer_failure(conn, Frame(code, request_id), exc)

    return run


def call_reply(reply: Reply, error: str | None) -> None:
    """Run one reply of a loop; a failure is logged and the loop goes on."""
    try:
        reply(error)
    except Exception:  # the reply's request stays unanswered; every other one is answered
        log.exception("a deferred reply failed; the other replies go on")
