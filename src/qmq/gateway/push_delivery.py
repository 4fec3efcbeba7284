"""One HTTP push subscription at work: a ``qmq.aio`` listener of its consumer group whose handler
POSTs each message to the subscription's URL.

The handler is an ordinary listener handler, so everything after a failure is the SDK's: a
delivery that is not answered 2xx in ``timeout_ms`` (another status, a timeout, a refused
connection) raises ``PushDeliveryError``, and the message goes to the group's retry subject
with its back-off, and after ``max_retries`` failures to the dead letters, exactly as for a
failing listener. A 2xx answer returns, which acknowledges it.

Each subscription has its own consumer, listener and HTTP connection pool (at most
``concurrency`` connections), so a slow endpoint holds only its own workers.

A delivery (``Content-Type: application/json``)::

    {"message_id", "subject", "group", "times", "created_ms", "properties", "tags",
     "body": text | "body_base64": base64}              body: when it is valid UTF-8
    X-Qmq-Message-Id, X-Qmq-Subject, X-Qmq-Group, X-Qmq-Attempt (1 for a first delivery)
    X-Qmq-Signature: sha256=<lowercase hex HMAC-SHA256 of the request body, keyed by the secret>
    ce-specversion: 1.0, ce-id (the message id), ce-source (/qmq/subjects/<subject>),
    ce-type (io.qmq.message), ce-time (RFC 3339, when the message was created)

A bytes property is sent as ``{"base64": "..."}`` so every property fits in JSON.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import hmac
import json
import logging
from datetime import UTC, datetime
from ssl import SSLContext
from typing import Any, Final
from urllib.parse import quote

import aiohttp

from qmq.aio import Consumer, ReceivedMessage
from qmq.client.telemetry import trace_headers
from qmq.common.errors import QmqError
from qmq.gateway.transforms import Transform, Transforms
from qmq.protocol.push import PushSubscription

log = logging.getLogger(__name__)

CE_TYPE: Final = "io.qmq.message"
# Every gateway consumes a subscription's group under this consumer id: a gateway taking over
# a subscription is the same consumer coming back, so the broker hands it at once what the
# gateway before it pulled and never acknowledged.
PUSH_CONSUMER_ID: Final = "qmq-push"
# What a listener pulls ahead per subscription: enough to keep ``concurrency`` deliveries busy.
_PREFETCH_PER_SLOT: Final = 2
_PREFETCH_MIN: Final = 16
# An answer's body is not used; this much is read so the connection can be kept alive.
_ANSWER_BYTES_READ_MAX: Final = 64 * 1024
# What a header value carries as it is, by the CloudEvents HTTP binding: printable ASCII but
# space, '"' and '%'; anything else is percent-encoded (UTF-8).
_HEADER_SAFE: Final = "".join(c for c in map(chr, range(0x21, 0x7F)) if c not in ' "%')


class PushDeliveryError(QmqError):
    """A delivery was not acknowledged (an answer other than 2xx, a timeout, no connection)."""

    retriable = True


def signature(secret: str, body: bytes) -> str:
    """``sha256=<hex>``: the HMAC-SHA256 of ``body`` keyed by ``secret`` (UTF-8)."""
    return "sha256=" + hmac.new(secret.encode("utf-8"), body, hashlib.sha256).hexdigest()


def _rfc3339(ms: int) -> str:
    return datetime.fromtimestamp(ms / 1000, tz=UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def _json_value(value: object) -> object:
    if isinstance(value, bytes):
        return {"base64": base64.b64encode(value).decode("ascii")}
    return value


def delivery_body(m: ReceivedMessage, group: str, transform: Transform | None = None) -> bytes:
    """The JSON document POSTed for ``m``; with ``transform``, its result is the body
    (DeadLetterNow when it cannot be evaluated: the listener dead-letters the message)."""
    doc: dict[str, Any] = {
        "message_id": m.message_id,
        "subject": m.subject,
        "group": group,
        "times": m.times,
        "created_ms": m.created_ms,
        "properties": {k: _json_value(v) for k, v in m.properties.items()},
        "tags": list(m.tags),
    }
    raw = m.body if transform is None else transform.body_of(m)
    try:
        doc["body"] = raw.decode("utf-8")
    except UnicodeDecodeError:
        doc["body_base64"] = base64.b64encode(raw).decode("ascii")
    return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode("utf-8")


def header_text(value: str) -> str:
    """``value`` as a header value: printable ASCII as it is, but space, '"' and '%' and anything
    else percent-encoded, as the CloudEvents HTTP binding does."""
    return quote(value, safe=_HEADER_SAFE)


def delivery_headers(sub: PushSubscription, m: ReceivedMessage, body: bytes) -> dict[str, str]:
    """The headers of ``m``'s delivery (``header_text`` for ids and names)."""
    message_id = header_text(m.message_id)
    subject = header_text(m.subject)
    headers = {
        "Content-Type": "application/json",
        "X-Qmq-Message-Id": message_id,
        "X-Qmq-Subject": subject,
        "X-Qmq-Group": header_text(sub.group),
        "X-Qmq-Attempt": str(m.times),
        "ce-specversion": "1.0",
        "ce-id": message_id,
        "ce-source": f"/qmq/subjects/{subject}",
        "ce-type": CE_TYPE,
        "ce-time": _rfc3339(m.created_ms),
    }
    if sub.secret:
        headers["X-Qmq-Signature"] = signature(sub.secret, body)
    headers.update(trace_headers(m.properties))  # the receiver's span continues the message's trace
    return headers


class RateLimiter:
    """At most ``rate_per_s`` starts per second, evenly spaced (0: no bound). Callers wait their slot;
    there are at most ``concurrency`` of them, the listener's workers."""

    def __init__(self, rate_per_s: int) -> None:
        self._interval_s = 1 / rate_per_s if rate_per_s > 0 else 0.0
        self._next_s = 0.0

    async def wait(self) -> None:
        if not self._interval_s:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        slot = max(now, self._next_s)
        self._next_s = slot + self._interval_s
        if slot > now:
            await asyncio.sleep(slot - now)  # the pace of the rate bound, not a readiness wait


class PushRunner:
    """Delivers one subscription while this gateway holds its lease: ``await start()``, ``await stop()``."""

    def __init__(
        self,
        sub: PushSubscription,
        generation: int,
        meta_server: str,
        app_code: str,
        ssl: SSLContext | None = None,
        transforms: Transforms | None = None,
    ) -> None:
        self.sub = sub
        self._transforms = transforms
        self.generation = generation
        self._meta_server = meta_server
        self._app_code = app_code
        self._ssl = ssl  # toward the cluster only: deliveries to the subscription's URL use the system's trust
        self._limiter = RateLimiter(sub.rate_per_s)
        self._session: aiohttp.ClientSession | None = None
        self._consumer: Consumer | None = None
        self.delivered = 0
        self.failed = 0

    async def start(self) -> None:
        sub = self.sub
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=sub.concurrency),
            timeout=aiohttp.ClientTimeout(total=sub.timeout_ms / 1000),
            headers={"User-Agent": "qmq-push"},
        )
        consumer = Consumer(
            app_code=self._app_code, meta_server=self._meta_server, consumer_id=PUSH_CONSUMER_ID, ssl=self._ssl
        )
        consumer.add_listener(
            sub.subject,
            sub.group,
            self._deliver,
            # The group's place was fixed when the subscription was added (qmq push add); a broker
            # group it has never pulled was routed the subject later and holds only later messages.
            start_from="earliest",
            concurrency=sub.concurrency,
            prefetch=max(_PREFETCH_MIN, _PREFETCH_PER_SLOT * sub.concurrency),
            tags=list(sub.tags),
            tag_type="and" if sub.tag_type == "and" else "or",
            max_retries=sub.max_retries,
            retry_backoff=[ms / 1000 for ms in sub.retry_backoff_ms],
        )
        try:
            await consumer.start()
        except BaseException:
            await consumer.close()
            await self._session.close()
            raise
        self._consumer = consumer

    async def stop(self) -> None:
        """Stop pulling; deliveries in flight finish (up to the consumer's close timeout); acks are sent."""
        consumer, self._consumer = self._consumer, None
        session, self._session = self._session, None
        try:
            if consumer is not None:
                await consumer.close()
        finally:
            if session is not None:
                await session.close()

    @property
    def errors(self) -> list[str]:
        return [] if self._consumer is None else self._consumer.errors

    async def _deliver(self, m: ReceivedMessage) -> None:
        session = self._session
        if session is None:
            raise PushDeliveryError("the push runner is stopped; the message is delivered again later")
        sub = self.sub
        transform = None if self._transforms is None else self._transforms.of(sub.subject, sub.group)
        body = delivery_body(m, sub.group, transform)
        headers = delivery_headers(sub, m, body)
        await self._limiter.wait()
        try:
            async with session.post(sub.url, data=body, headers=headers, allow_redirects=False) as answer:
                await answer.content.read(_ANSWER_BYTES_READ_MAX)
                status = answer.status
        except TimeoutError:
            self.failed += 1
            raise PushDeliveryError(f"{sub.url} did not answer within timeout_ms={sub.timeout_ms}") from None
        except aiohttp.ClientError as exc:
            self.failed += 1
            raise PushDeliveryError(f"{sub.url} could not be reached: {type(exc).__name__}: {exc}") from None
        if not 200 <= status < 300:
            self.failed += 1
            raise PushDeliveryError(f"{sub.url} answered HTTP {status}; only a 2xx answer acknowledges")
        self.delivered += 1
