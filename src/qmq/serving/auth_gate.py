"""The auth gate of a frame-serving role with an auth file (``--auth-file``): every connection
authenticates once (AUTH_HELLO, AUTH_PROOF; ``qmq.auth.handshake``), and every request after
is checked against what its app may do (``qmq.auth.permissions``) before its handler runs.

    AUTH_HELLO / AUTH_PROOF     the handshake; a wrong proof is answered UNAUTHENTICATED and
                                the connection closed
    anything before the proof   UNAUTHENTICATED
    SEND_MESSAGES               produce, per subject of the frame (checked by the handlers,
                                which read the subjects: ``RoleHandlers.take_send``)
    PULL, ACK, DEAD_LETTERS     consume on subject:group; ACK_MANY each of its pairs
    READ                        consume on the subject, for every group
    RESET_OFFSET, RESEND_DEAD,  admin
    PURGE_DEAD, other codes
    REPLICATE                   cluster (only the servers' own identity)
    PING, SUBJECTS, LAG,        any authenticated app
    DELAY_STATS

A refusal (FORBIDDEN) names the app, the action and the subject, nothing else; it is counted
(``<role>_auth_denials{reason}``) and logged without secrets. Repeated failed handshakes from
one address are answered later and later (``qmq.auth.failures``), never refused.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from qmq.auth.failures import FailedHandshakes, address_of
from qmq.auth.file import App, AuthConfig
from qmq.auth.handshake import AuthFailed, HandshakeError, ServerHandshake
from qmq.auth.permissions import Action
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import FrameConnection, Responder

log = logging.getLogger(__name__)

Dispatch = Callable[[Responder, Frame], None]
Need = tuple[Action, str | None, str | None]

_OPEN = frozenset({RequestCode.PING, RequestCode.SUBJECTS, RequestCode.LAG, RequestCode.DELAY_STATS})
# the handlers check these themselves, once they have read the subjects from the body
_BY_HANDLER = frozenset({RequestCode.SEND_MESSAGES})
_CONSUME = frozenset({RequestCode.PULL, RequestCode.ACK, RequestCode.DEAD_LETTERS})
_ACK_MANY_CHECKED_MAX = 10_000


def _names(value: object) -> str | None:
    return value if isinstance(value, str) else None


def needs(frame: Frame) -> Iterable[Need]:
    """What a request (other than a send or the handshake) needs its app to be allowed."""
    code, header = frame.code, frame.header
    if code in _OPEN or code in _BY_HANDLER:
        return ()
    if code in _CONSUME:
        return ((Action.CONSUME, _names(header.get("subject")), _names(header.get("group"))),)
    if code == RequestCode.READ:
        return ((Action.CONSUME, _names(header.get("subject")), None),)
    if code == RequestCode.ACK_MANY:
        entries = header.get("acks")
        if not isinstance(entries, list):
            return ()  # the handler answers BAD_REQUEST
        return [
            (Action.CONSUME, _names(e.get("subject")), _names(e.get("group")))
            for e in entries[:_ACK_MANY_CHECKED_MAX]
            if isinstance(e, dict)
        ]
    if code == RequestCode.REPLICATE:
        return ((Action.CLUSTER, None, None),)
    return ((Action.ADMIN, None, None),)


def refusal_text(app: str, action: Action, subject: str | None) -> str:
    what = f"{action.value} {subject!r}" if subject is not None else action.value
    return f"app {app!r} may not {what}; ask for it in the auth file's [apps.{app}] (docs/security.md)"


class AuthGate:
    """Authenticates the connections of one server and checks their requests."""

    def __init__(self, auth: AuthConfig, registry: CollectorRegistry, prefix: str) -> None:
        self.auth = auth
        self._decoy_key = os.urandom(32)
        self.failures = FailedHandshakes()
        self.denials = Counter(
            f"{prefix}_auth_denials",
            "requests refused by the auth file, by reason: handshake (a wrong secret or unknown app), "
            "unauthenticated (a request before the handshake), forbidden (an action the app may not do)",
            ["reason"],
            registry=registry,
        )

    def reload(self, auth: AuthConfig) -> None:
        """Take a new auth file: connections stay open; their next request is checked against it."""
        self.auth = auth

    def wrap(self, dispatch: Dispatch) -> Dispatch:
        def gated(conn: Responder, frame: Frame) -> None:
            assert isinstance(conn, FrameConnection)
            code = frame.code
            if code == RequestCode.AUTH_HELLO:
                self._hello(conn, frame)
            elif code == RequestCode.AUTH_PROOF:
                self._proof(conn, frame)
            elif conn.app_code is None or (app := self.auth.app(conn.app_code)) is None:
                # no handshake yet, or the app left the auth file since (a reload)
                self.denials.labels("unauthenticated").inc()
                conn.respond(
                    code,
                    frame.request_id,
                    {
                        "error": "this server needs an app code and secret: authenticate first "
                        "(app_code= and secret= or $QMQ_SECRET in the SDK, --app-code and --secret in the CLI)",
                        "action": "authenticate",
                    },
                    status=Status.UNAUTHENTICATED,
                )
            else:
                for action, subject, group in needs(frame):
                    if not app.grants.allows(action, subject, group):
                        self.deny(conn, frame, action, subject)
                        return
                conn.grants = app.grants
                dispatch(conn, frame)

        return gated

    def deny(self, conn: Responder, frame: Frame, action: Action, subject: str | None) -> None:
        app = getattr(conn, "app_code", None) or "?"
        self.denials.labels("forbidden").inc()
        log.warning("refused %s of app %r: %s %r", RequestCode(frame.code).name, app, action.value, subject)
        header: dict[str, Any] = {
            "error": refusal_text(app, action, subject),
            "app": app,
            "action": action.value,
            "subject": subject,
        }
        conn.respond(frame.code, frame.request_id, header, status=Status.FORBIDDEN)

    def _hello(self, conn: FrameConnection, frame: Frame) -> None:
        handshake = ServerHandshake(self.auth, self._decoy_key)
        conn.handshake = handshake
        try:
            challenge = handshake.challenge(frame.header).to_wire()
        except HandshakeError as exc:
            conn.respond(frame.code, frame.request_id, {"error": str(exc)}, status=Status.BAD_REQUEST)
            return
        delay_s = self.failures.delay_s(address_of(conn.peer), time.monotonic())
        if delay_s:
            asyncio.get_running_loop().call_later(delay_s, conn.respond, frame.code, frame.request_id, challenge)
        else:
            conn.respond(frame.code, frame.request_id, challenge)

    def _proof(self, conn: FrameConnection, frame: Frame) -> None:
        handshake = conn.handshake
        if not isinstance(handshake, ServerHandshake):
            conn.respond(
                frame.code, frame.request_id, {"error": "AUTH_PROOF comes after AUTH_HELLO"}, status=Status.BAD_REQUEST
            )
            return
        conn.handshake = None
        try:
            app: App = handshake.verify(frame.header)
        except HandshakeError as exc:
            conn.respond(frame.code, frame.request_id, {"error": str(exc)}, status=Status.BAD_REQUEST)
            return
        except AuthFailed as exc:
            self.failures.failed(address_of(conn.peer), time.monotonic())
            self.denials.labels("handshake").inc()
            log.warning("failed handshake from %s: %s", conn.peer, exc)
            header = {"error": str(exc), "app": exc.app_code, "action": "authenticate"}
            conn.respond(frame.code, frame.request_id, header, status=Status.UNAUTHENTICATED)
            conn.close()
            return
        conn.app_code = app.code
        conn.grants = app.grants
        conn.respond(frame.code, frame.request_id, {"app": app.code})
