"""The broker's administrative requests: listings (subjects, lag, dead letters, answered one
page at a time, ``listings.py``), resetting a group's offset, resending and purging dead
letters, and the trace of one message id read from the broker's files on a thread."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from qmq.broker.listings import dead_letters_page, lag_page, subjects_page
from qmq.broker.trace import trace_message
from qmq.common.naming import retry_subject
from qmq.protocol.answers import encode_answer
from qmq.protocol.codes import Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.replies import guarded
from qmq.serving.requests import BadRequest, get_bool, get_group, get_subject
from qmq.store.redelivery import purge_dead, resend_dead

if TYPE_CHECKING:
    from qmq.broker.handlers import BrokerContext

log = logging.getLogger(__name__)

_TRACE_ID_CHARS_MAX = 255  # a message id's most, as the SDK encodes it


class AdminHandlers:
    def __init__(self, broker: BrokerContext) -> None:
        self.broker, self.store = broker, broker.store

    def subjects(self, conn: Responder, frame: Frame) -> None:
        conn.respond(frame.code, frame.request_id, None, (subjects_page(self.store, frame.header),))

    def lag(self, conn: Responder, frame: Frame) -> None:
        now_ms = self.broker.clock.now_ms()
        page = lag_page(self.store, frame.header, now_ms, self.broker.config.consumer_offline_ms)
        conn.respond(frame.code, frame.request_id, None, (page,))

    def reset_offset(self, conn: Responder, frame: Frame) -> None:
        header = frame.header
        subject = get_subject(header)
        group = get_group(header)
        to = header.get("to")
        if to not in ("earliest", "latest") and (not isinstance(to, int) or isinstance(to, bool) or to < 0):
            raise BadRequest(f"'to' = {to!r}: use 'earliest', 'latest' or a time in epoch milliseconds")
        gp = self.store.group(subject, group, "latest")
        before = gp.pull_offset
        seq = self.store.reset(gp, to)
        log.info("group %r of %r reset from %d to %d (%s)", group, subject, before, seq, to)
        conn.respond(frame.code, frame.request_id, {"pull_offset": seq, "before": before})

    def _dead_args(self, frame: Frame) -> tuple[str, str, str | None]:
        header = frame.header
        subject = get_subject(header)
        group = get_group(header)
        message_id = header.get("message_id")
        if message_id is not None and not isinstance(message_id, str):
            raise BadRequest(f"'message_id' must be a string, got {type(message_id).__name__}")
        if message_id is None and not get_bool(header, "all"):
            raise BadRequest("name one dead letter with 'message_id', or pass 'all': true")
        return subject, group, message_id

    def dead_letters(self, conn: Responder, frame: Frame) -> None:
        conn.respond(frame.code, frame.request_id, None, (dead_letters_page(self.store, frame.header),))

    def resend_dead(self, conn: Responder, frame: Frame) -> None:
        subject, group, message_id = self._dead_args(frame)
        resent = resend_dead(self.store, subject, group, message_id)
        log.info("resent %d dead letter(s) of %r / %r", resent, subject, group)
        code, request_id = frame.code, frame.request_id

        def durable(error: str | None) -> None:
            if error is None:
                conn.respond(code, request_id, {"resent": resent})
            else:
                conn.respond(code, request_id, {"error": error}, status=Status.INTERNAL_ERROR)

        if resent and self.store.sync_policy:
            self.broker.flusher.after_write(self.store.mlog.end, guarded(conn, code, request_id, durable))
        else:
            durable(None)
            if resent:
                self.broker.parked.notify({retry_subject(subject, group)})

    def trace(self, conn: Responder, frame: Frame) -> None:
        """What the files tell of one message id, read on a thread (qmq.broker.trace)."""
        message_id = frame.header.get("message_id")
        if not isinstance(message_id, str) or not 0 < len(message_id) <= _TRACE_ID_CHARS_MAX:
            raise BadRequest(f"'message_id' must be a message id (1 to {_TRACE_ID_CHARS_MAX} characters)")
        code, request_id = frame.code, frame.request_id
        done = asyncio.get_running_loop().run_in_executor(
            None, trace_message, Path(self.broker.config.data_dir), message_id
        )

        def answer(fut: asyncio.Future[dict[str, Any]]) -> None:
            if not fut.cancelled():  # a trace that failed raises here: guarded answers its error
                conn.respond(code, request_id, None, (encode_answer(fut.result()),))

        done.add_done_callback(guarded(conn, code, request_id, answer))

    def purge_dead(self, conn: Responder, frame: Frame) -> None:
        subject, group, message_id = self._dead_args(frame)
        purged = purge_dead(self.store, subject, group, message_id)
        log.info("purged %d dead letter(s) of %r / %r", purged, subject, group)
        conn.respond(frame.code, frame.request_id, {"purged": purged})
