"""The auth gate of a frame-serving role with an auth file (``--auth-file``): every connection
authenticates once (AUTH_HELLO, AUTH_PROOF; ``qmq.auth.handshake``), and every request after
is checked against what its app may do (``qmq.auth.permissions``) before its handler runs.

    AUTH_HELLO / AUTH_PROOF     the handshake; a wrong proof is answered UNAUTHENTICATED and
                                the connection closed
    anything before the proof   UNAUTHENTICATED
    SEND_MESSAGES               produce, per subject of the frame (checked by the handlers,
                                which read the subjects: ``RoleHandlers.take_send``)
    PULL, ACK, SETTLE, DEAD_LETTERS  consume on subject:group; ACK_MANY, PULL_MANY each of their pairs
    READ, DELAY_LIST            consume on the subject, for every group
    RESET_OFFSET, RESEND_DEAD,  admin (CANCEL_DELAY too: it names a message id, not a subject)
    PURGE_DEAD, CANCEL_DELAY,
    other codes
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
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Counter

from qmq.auth.failures import FailedHandshakes, address_of
from qmq.auth.file import App, AuthConfig
from qmq.auth.handshake import AuthFailed, HandshakeError, ServerHandshake
from qmq.auth.permissions import Action
from qmq.auth.quotas import BURST_S, Buckets, QuotaRule, quota_for
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.protocol.message import ScannedMessage
from qmq.serving.connection import FrameConnection, Responder

log = logging.getLogger(__name__)

Dispatch = Callable[[Responder, Frame], None]
Need = tuple[Action, str | None, str | None]

_OPEN = frozenset({RequestCode.PING, RequestCode.SUBJECTS, RequestCode.LAG, RequestCode.DELAY_STATS})
# the handlers check these themselves, once they have read the subjects from the body
_BY_HANDLER = frozenset({RequestCode.SEND_MESSAGES})
_CONSUME = frozenset({RequestCode.PULL, RequestCode.ACK, RequestCode.SETTLE, RequestCode.DEAD_LETTERS})
_ACK_MANY_CHECKED_MAX = 10_000
# a pull over its quota waits at most this long before it is looked at again
_PULL_HELD_S_MAX = 1.0


def _names(value: object) -> str | None:
    return value if isinstance(value, str) else None


def needs(frame: Frame) -> Iterable[Need]:
    """What a request (other than a send or the handshake) needs its app to be allowed."""
    code, header = frame.code, frame.header
    if code in _OPEN or code in _BY_HANDLER:
        return ()
    if code in _CONSUME:
        return ((Action.CONSUME, _names(header.get("subject")), _names(header.get("group"))),)
    if code in (RequestCode.READ, RequestCode.DELAY_LIST):
        return ((Action.CONSUME, _names(header.get("subject")), None),)
    if code in (RequestCode.ACK_MANY, RequestCode.PULL_MANY):
        entries = header.get("acks" if code == RequestCode.ACK_MANY else "pulls")
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


def _code_name(code: int) -> str:
    try:
        return RequestCode(code).name
    except ValueError:
        return f"request code {code}"


def refusal_text(app: str, action: Action, subject: str | None) -> str:
    what = f"{action.value} {subject!r}" if subject is not None else action.value
    return f"app {app!r} may not {what}; ask for it in the auth file's [apps.{app}] (docs/security.md)"


class AuthGate:
    """Authenticates the connections of one server and checks their requests."""

    def __init__(self, auth: AuthConfig, registry: CollectorRegistry, prefix: str) -> None:
        self.auth = auth
        self._decoy_key = os.urandom(32)
        self.failures = FailedHandshakes()
        self.buckets = Buckets()
        # quotas set at run time, by app (qmq.serving.limits)
        self.runtime: dict[str, tuple[QuotaRule, ...]] = {}
        self.throttled = Counter(
            f"{prefix}_quota_throttled",
            "requests over their app's quota, by kind: produce (answered THROTTLED), consume (a pull held back)",
            ["kind"],
            registry=registry,
        )
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
            if conn.closed:  # a pull held back over its quota whose connection went meanwhile
                return
            code = frame.code
            if code == RequestCode.AUTH_HELLO:
                self._hello(conn, frame)
            elif code == RequestCode.AUTH_PROOF:
                self._proof(conn, frame)
            elif conn.app_code is None and conn.cert_subject is not None and self._by_certificate(conn):
                gated(conn, frame)
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
                if code == RequestCode.PULL and self._held_back(conn, frame, app, gated):
                    return
                if code == RequestCode.PULL_MANY:
                    self._charge_entries(frame, app)
                dispatch(conn, frame)

        return gated

    def rules(self, app: App) -> tuple[QuotaRule, ...]:
        """The app's quotas: those set at run time (qmq limits set) first, then the auth file's."""
        runtime = self.runtime.get(app.code)
        return runtime + app.quotas if runtime else app.quotas

    def _by_certificate(self, conn: FrameConnection) -> bool:
        """A client certificate (verified against --tls-ca) whose common name is an app of the
        file stands for that app: the connection needs no handshake."""
        app = self.auth.app(conn.cert_subject or "")
        if app is None:
            return False
        conn.app_code = app.code
        conn.grants = app.grants
        return True

    # -- quotas (qmq.auth.quotas) ---------------------------------------------------------

    def _held_back(self, conn: FrameConnection, frame: Frame, app: App, gated: Dispatch) -> bool:
        """A pull over the consume quota of its subject:group waits (then is handled again);
        one under it asks for at most a tenth of a second's worth, which is charged."""
        subject, group = _names(frame.header.get("subject")), _names(frame.header.get("group"))
        if subject is None or group is None:
            return False
        rules = self.rules(app)
        if not rules:
            return False
        quota = quota_for(rules, subject, group)
        if quota is None or not quota.consume_msgs_per_s:
            return False
        rate = quota.consume_msgs_per_s
        key = ("consume", app.code, subject, group)
        now = time.monotonic()
        wait_s = self.buckets.wait_s(key, rate, now)
        if wait_s > 0:
            self.throttled.labels("consume").inc()
            asyncio.get_running_loop().call_later(min(wait_s, _PULL_HELD_S_MAX), gated, conn, frame)
            return True
        most = max(1, math.ceil(rate * BURST_S))
        asked = frame.header.get("max")
        if not isinstance(asked, int) or isinstance(asked, bool) or asked > most:
            frame.header["max"] = most
        self.buckets.take(key, rate, frame.header["max"], now)
        return False

    def _charge_entries(self, frame: Frame, app: App) -> None:
        """PULL_MANY never waits: an entry whose subject:group is over its consume quota pulls
        nothing this time (its acks still apply: ``max`` 0), one under it at most a tenth of a
        second's worth, which is charged — the same quota PULL is held to."""
        entries = frame.header.get("pulls")
        rules = self.rules(app)
        if not rules or not isinstance(entries, list):
            return
        now = time.monotonic()
        for entry in entries:
            if not isinstance(entry, dict):
                continue  # the broker answers that entry's error
            subject, group = _names(entry.get("subject")), _names(entry.get("group"))
            if subject is None or group is None:
                continue
            quota = quota_for(rules, subject, group)
            if quota is None or not quota.consume_msgs_per_s:
                continue
            rate = quota.consume_msgs_per_s
            key = ("consume", app.code, subject, group)
            if self.buckets.wait_s(key, rate, now) > 0:
                self.throttled.labels("consume").inc()
                entry["max"] = 0
                continue
            most = max(1, math.ceil(rate * BURST_S))
            asked = entry.get("max")
            if not isinstance(asked, int) or isinstance(asked, bool) or asked > most:
                entry["max"] = most
            self.buckets.take(key, rate, entry["max"], now)

    def over_quota(self, conn: Responder, frame: Frame, scanned: Sequence[ScannedMessage]) -> bool:
        """Answer a send THROTTLED (with retry_after_ms) when a subject of it is over its
        app's produce quota; otherwise charge the quotas and return False."""
        app_code = getattr(conn, "app_code", None)
        app = self.auth.app(app_code) if app_code is not None else None
        rules = self.rules(app) if app is not None else ()
        if app is None or not rules:
            return False
        counts: dict[bytes, list[int]] = {}
        for m in scanned:
            c = counts.setdefault(m.subject, [0, 0])
            c[0] += 1
            c[1] += m.length
        now = time.monotonic()
        charges = []
        for raw, (msgs, size) in counts.items():
            subject = raw.decode("utf-8", "replace")
            quota = quota_for(rules, subject)
            if quota is None:
                continue
            for what, rate, amount in (
                ("msgs", quota.produce_msgs_per_s, msgs),
                ("bytes", quota.produce_bytes_per_s, size),
            ):
                if not rate:
                    continue
                key = ("produce", what, app.code, subject)
                wait_s = self.buckets.wait_s(key, rate, now)
                if wait_s > 0:
                    self.throttled.labels("produce").inc()
                    header = {
                        "error": f"app {app.code!r} is over its quota of {rate:g} {what}/s for {subject!r}; "
                        "send again after retry_after_ms",
                        "retry_after_ms": math.ceil(wait_s * 1000),
                        "app": app.code,
                        "subject": subject,
                    }
                    conn.respond(frame.code, frame.request_id, header, status=Status.THROTTLED)
                    return True
                charges.append((key, rate, amount))
        for key, rate, amount in charges:
            self.buckets.take(key, rate, amount, now)
        return False

    def deny(self, conn: Responder, frame: Frame, action: Action, subject: str | None) -> None:
        app = getattr(conn, "app_code", None) or "?"
        self.denials.labels("forbidden").inc()
        what = f"{action.value} {subject!r}" if subject is not None else action.value
        log.warning("refused %s of app %r: may not %s", _code_name(frame.code), app, what)
        header: dict[str, Any] = {
            "error": refusal_text(app, action, subject),
            "app": app,
            "action": action.value,
            "subject": subject,
        }
        conn.respond(frame.code, frame.request_id, header, status=Status.FORBIDDEN)

    def _hello(self, conn: FrameConnection, frame: Frame) -> None:
        if conn.handshake is not None:  # one handshake at a time: a held-back HELLO holds a timer
            text = "a connection sends one AUTH_HELLO, then its AUTH_PROOF, before another"
            conn.respond(frame.code, frame.request_id, {"error": text}, status=Status.BAD_REQUEST)
            return
        handshake = ServerHandshake(self.auth, self._decoy_key)
        conn.handshake = handshake
        try:
            challenge = handshake.challenge(frame.header).to_wire()
        except HandshakeError as exc:
            conn.handshake = None
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
