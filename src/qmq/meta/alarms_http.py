"""The meta server's HTTP API of backlog alarms, and the notifications it POSTs.

Routes:
    GET    /meta/alarms                        every alarm with its state and last lag (secrets as "***")
    POST   /meta/alarms                        add one: {"subject", "group", "lag_over", "for_ms", "webhook",
                                               "secret"}; 201, 409 when one of that subject and group exists
    DELETE /meta/alarms?subject=S&group=G      remove one; 404 when there is none

A notification is one POST of a JSON document to the alarm's webhook::

    {"event": "breach_started" | "breach_ended", "subject", "group", "lag", "lag_over", "for_ms",
     "at": RFC 3339, "crossed_at": RFC 3339 (when the lag crossed the bound)}

with the headers ``X-Qmq-Alarm-Event`` and, when the alarm has a secret, ``X-Qmq-Signature:
sha256=<hex>``, the HMAC-SHA256 of the body keyed by the secret: the signature of an HTTP push
delivery. A webhook that fails is tried ``_ATTEMPTS`` times in all, then the notice is logged
and dropped (the alarm's state has moved on: it is never sent again).
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime
from typing import Any, Final

import aiohttp
from aiohttp import web

from qmq.common.clock import Clock
from qmq.common.errors import InvalidSubjectError
from qmq.common.naming import check_name
from qmq.meta.alarms import (
    FOR_MS_DEFAULT,
    FOR_MS_MAX,
    LAG_OVER_MAX,
    Alarm,
    AlarmExistsError,
    AlarmsFullError,
    AlarmStore,
    Notice,
)
from qmq.meta.schema import PUSH_SECRET_CHARS, PUSH_URL_CHARS

log = logging.getLogger(__name__)

ALARMS_PATH: Final = "/meta/alarms"
_ATTEMPTS: Final = 3
_RETRY_AFTER_S: Final = 1.0
_TIMEOUT_S: Final = 5.0
# notifications being sent at once; past this a notice is logged and dropped
_SENDING_MAX: Final = 100

Call = Callable[..., Awaitable[Any]]


def signature(secret: str, body: bytes) -> str:
    """``sha256=<hex>``, as an HTTP push delivery is signed."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def _rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def notice_body(notice: Notice) -> bytes:
    a = notice.alarm
    doc = {
        "event": notice.event,
        "subject": a.subject,
        "group": a.group,
        "lag": notice.lag,
        "lag_over": a.lag_over,
        "for_ms": a.for_ms,
        "at": _rfc3339(notice.at_ms),
        "crossed_at": _rfc3339(notice.crossed_ms),
    }
    return json.dumps(doc, separators=(",", ":")).encode("utf-8")


class _FieldError(ValueError):
    def __init__(self, field: str, text: str) -> None:
        super().__init__(text)
        self.field = field


def parse_alarm(body: object, now_ms: int) -> Alarm:
    """An alarm from a POST body; _FieldError naming the field that is wrong."""
    if not isinstance(body, dict):
        raise _FieldError("body", f"the alarm must be a JSON object, got {type(body).__name__}")
    try:
        subject = check_name("subject", body.get("subject", ""))
        group = check_name("consumer group", body.get("group", ""))
    except InvalidSubjectError as exc:
        raise _FieldError("subject" if "subject" in str(exc) else "group", str(exc)) from None
    lag_over = body.get("lag_over")
    if isinstance(lag_over, bool) or not isinstance(lag_over, int) or not 0 <= lag_over <= LAG_OVER_MAX:
        raise _FieldError("lag_over", f"lag_over {lag_over!r} must be a whole number of messages from 0 to 2^62")
    for_ms = body.get("for_ms", FOR_MS_DEFAULT)
    if isinstance(for_ms, bool) or not isinstance(for_ms, int) or not 0 <= for_ms <= FOR_MS_MAX:
        raise _FieldError("for_ms", f"for_ms {for_ms!r} must be whole milliseconds from 0 to {FOR_MS_MAX} (7 days)")
    webhook = body.get("webhook")
    if not isinstance(webhook, str) or not webhook.startswith(("http://", "https://")) or len(webhook) > PUSH_URL_CHARS:
        raise _FieldError("webhook", f"webhook {webhook!r:.80} must be an http:// or https:// URL")
    secret = body.get("secret", "")
    if not isinstance(secret, str) or len(secret) > PUSH_SECRET_CHARS:
        raise _FieldError("secret", f"secret must be a string of at most {PUSH_SECRET_CHARS} characters")
    return Alarm(subject, group, lag_over, for_ms, webhook, secret, now_ms)


def _refused(status: int, text: str, field: str | None = None) -> web.Response:
    body: dict[str, Any] = {"error": text}
    if field is not None:
        body["field"] = field
    return web.json_response(body, status=status)


class AlarmApi:
    """The alarm routes of one meta server and its notifier; ``call`` runs on its store thread."""

    def __init__(self, call: Call, store: Callable[[], AlarmStore], clock: Clock) -> None:
        self._call = call
        self._store = store
        self._clock = clock
        self._sending: set[asyncio.Task[None]] = set()
        self._http: aiohttp.ClientSession | None = None

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get(ALARMS_PATH, self._list)
        app.router.add_post(ALARMS_PATH, self._add)
        app.router.add_delete(ALARMS_PATH, self._remove)

    async def _list(self, _request: web.Request) -> web.Response:
        alarms: list[Alarm] = await self._call(lambda: self._store().rows())
        return web.json_response({"time_ms": self._clock.now_ms(), "alarms": [a.json() for a in alarms]})

    async def _add(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())
        except (ValueError, UnicodeDecodeError, RecursionError) as exc:
            return _refused(400, f"the alarm body is not JSON ({type(exc).__name__}); send a JSON object", "body")
        try:
            alarm = parse_alarm(body, self._clock.now_ms())
        except _FieldError as exc:
            return _refused(400, str(exc), exc.field)
        try:
            await self._call(lambda: self._store().add(alarm))
        except AlarmExistsError as exc:
            return _refused(409, str(exc), "group")
        except AlarmsFullError as exc:
            return _refused(409, str(exc))
        return web.json_response({"alarm": alarm.json()}, status=201)

    async def _remove(self, request: web.Request) -> web.Response:
        try:
            subject = check_name("subject", request.query.get("subject", ""))
            group = check_name("consumer group", request.query.get("group", ""))
        except InvalidSubjectError as exc:
            return _refused(400, f"{exc}; remove with DELETE {ALARMS_PATH}?subject=S&group=G")
        removed: bool = await self._call(lambda: self._store().remove(subject, group))
        if not removed:
            return _refused(404, f"there is no alarm of subject {subject!r} for group {group!r}", "group")
        return web.json_response({"removed": True, "subject": subject, "group": group})

    # -- notifications ------------------------------------------------------------------------

    def notify(self, notices: list[Notice]) -> None:
        """Send each notice in the background (at most ``_SENDING_MAX`` at once)."""
        for notice in notices:
            if len(self._sending) >= _SENDING_MAX:
                log.error(
                    "alarm %s/%s: %s not sent: %d notifications are being sent already",
                    notice.alarm.subject,
                    notice.alarm.group,
                    notice.event,
                    len(self._sending),
                )
                continue
            task = asyncio.get_running_loop().create_task(self._send(notice))
            self._sending.add(task)
            task.add_done_callback(self._sending.discard)

    async def _send(self, notice: Notice) -> None:
        a = notice.alarm
        body = notice_body(notice)
        headers = {"Content-Type": "application/json", "X-Qmq-Alarm-Event": notice.event}
        if a.secret:
            headers["X-Qmq-Signature"] = signature(a.secret, body)
        if self._http is None:
            self._http = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=_TIMEOUT_S))
        problem = ""
        for attempt in range(1, _ATTEMPTS + 1):
            try:
                async with self._http.post(a.webhook, data=body, headers=headers) as answer:
                    if answer.status < 300:
                        log.info("alarm %s/%s: %s sent to %s", a.subject, a.group, notice.event, a.webhook)
                        return
                    problem = f"it answered {answer.status}"
            except (aiohttp.ClientError, TimeoutError) as exc:
                problem = f"{type(exc).__name__}: {exc}"
            if attempt < _ATTEMPTS:
                await asyncio.sleep(_RETRY_AFTER_S * attempt)  # the webhook's back-off
        log.error(
            "alarm %s/%s: %s could not be sent to %s after %d attempts (%s); it is dropped",
            a.subject,
            a.group,
            notice.event,
            a.webhook,
            _ATTEMPTS,
            problem,
        )

    async def close(self) -> None:
        for task in list(self._sending):
            task.cancel()
        if self._sending:
            await asyncio.gather(*self._sending, return_exceptions=True)
        if self._http is not None:
            await self._http.close()
            self._http = None
