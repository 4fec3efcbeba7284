"""An HTTP push subscription as JSON: what ``qmq push add`` sends the meta server, what the meta
server stores and lists, and what a gateway is handed with its lease.

One definition for all three, sans-IO (no sockets, no asyncio): ``parse_subscription`` checks
every field of a decoded JSON object and names the first bad one with its value and what is
allowed; ``subscription_json`` is its inverse. Unknown keys are refused, so a typo such as
``"concurency"`` is an error rather than a default silently taken.

JSON object (defaults in brackets)::

    subject, group          the subject and the consumer group the gateway consumes as
    url                     http:// or https:// URL each message is POSTed to
    concurrency  [8]        most deliveries in flight at once, 1..1000
    rate_per_s   [0]        most deliveries started per second, 0 (no bound)..100000
    timeout_ms   [10000]    an answer later than this is a failure, 100..300000
    secret       [""]       key of X-Qmq-Signature (empty: no signature header), up to 200 chars
    tags         [[]]       the broker delivers only messages with any ("or") or all ("and")
    tag_type     ["or"]     of these tags, up to 10
    start_from   ["latest"] "latest": messages sent after the subscription was added; "earliest": the backlog too
    max_retries  [16]       failures before a message goes to the dead letters, 0..10000
    retry_backoff_ms        wait after the n-th failure, the last value repeating (the SDK's default)
    created_at_ms [0]       set by the meta server when it stores the subscription
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final
from urllib.parse import urlsplit

from qmq.common.errors import InvalidMessageError, InvalidSubjectError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.common.naming import check_name
from qmq.protocol.message import check_tag

CONCURRENCY_DEFAULT: Final = 8
CONCURRENCY_MAX: Final = 1_000
RATE_PER_S_MAX: Final = 100_000
TIMEOUT_MS_DEFAULT: Final = 10_000
TIMEOUT_MS_MIN: Final = 100
TIMEOUT_MS_MAX: Final = 300_000
SECRET_CHARS_MAX: Final = 200
URL_CHARS_MAX: Final = 2_000
MAX_RETRIES_DEFAULT: Final = 16
MAX_RETRIES_MAX: Final = 10_000
# The SDK's default back-off (qmq.client.subscription), in ms; the last value repeats.
RETRY_BACKOFF_MS_DEFAULT: Final = (
    5_000,
    10_000,
    30_000,
    60_000,
    120_000,
    300_000,
    600_000,
    1_800_000,
    3_600_000,
    7_200_000,
)
RETRY_BACKOFF_STEPS_MAX: Final = 32
RETRY_BACKOFF_MS_MAX: Final = 7 * 24 * 3_600_000
START_FROM: Final = ("latest", "earliest")
TAG_TYPES: Final = ("or", "and")
_INT_MAX: Final = (1 << 63) - 1


class PushFieldError(ValueError):
    """A field of a push subscription is missing or wrong; ``field`` names it."""

    def __init__(self, field: str, text: str) -> None:
        self.field = field
        super().__init__(text)


@dataclass(frozen=True, slots=True)
class PushSubscription:
    """One push subscription: deliver every message of ``subject`` in ``group`` to ``url``."""

    subject: str
    group: str
    url: str
    concurrency: int = CONCURRENCY_DEFAULT
    rate_per_s: int = 0
    timeout_ms: int = TIMEOUT_MS_DEFAULT
    secret: str = ""
    tags: tuple[str, ...] = ()
    tag_type: str = "or"
    start_from: str = "latest"
    max_retries: int = MAX_RETRIES_DEFAULT
    retry_backoff_ms: tuple[int, ...] = RETRY_BACKOFF_MS_DEFAULT
    created_at_ms: int = 0

    @property
    def key(self) -> tuple[str, str]:
        return self.subject, self.group


_FIELDS: Final = frozenset(PushSubscription.__dataclass_fields__)


def _int(body: dict[str, Any], field: str, default: int, low: int, high: int, what: str) -> int:
    value = body.get(field, default)
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise PushFieldError(field, f"{field} {value!r} is not allowed; {what}: a whole number from {low} to {high}")
    return value


def _choice(body: dict[str, Any], field: str, default: str, allowed: Sequence[str]) -> str:
    value = body.get(field, default)
    if value not in allowed:
        raise PushFieldError(field, f"{field} {value!r} is not allowed; use one of {', '.join(map(repr, allowed))}")
    return str(value)


def check_push_url(value: object) -> str:
    """An absolute http:// or https:// URL with a host; PushFieldError naming it otherwise."""
    if not isinstance(value, str) or not value:
        raise PushFieldError("url", f"url must be a non-empty string, got {value!r}; e.g. http://host:8080/hook")
    if len(value) > URL_CHARS_MAX:
        raise PushFieldError("url", f"url {value[:60]!r}… is longer than {URL_CHARS_MAX} characters")
    if any(ch.isspace() or ord(ch) < 0x20 for ch in value):
        raise PushFieldError("url", f"url {value!r} contains whitespace or a control character; percent-encode it")
    try:
        parts = urlsplit(value)
        _ = parts.port  # raises ValueError for a port that is not a number in range
    except ValueError as exc:
        raise PushFieldError("url", f"url {value!r} cannot be parsed ({exc}); e.g. http://host:8080/hook") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise PushFieldError(
            "url", f"url {value!r} is not an http:// or https:// URL with a host; e.g. http://host:8080/hook"
        )
    return value


def parse_subscription(body: object) -> PushSubscription:
    """The PushSubscription in a decoded JSON object; PushFieldError naming the first bad field."""
    if not isinstance(body, dict):
        raise PushFieldError("body", f"a push subscription must be a JSON object, got {type(body).__name__}")
    unknown = sorted(str(k) for k in body if k not in _FIELDS)
    if unknown:
        raise PushFieldError(
            unknown[0], f"unknown field(s) {', '.join(map(repr, unknown))}; the fields are {', '.join(sorted(_FIELDS))}"
        )
    for field in ("subject", "group", "url"):
        if field not in body:
            raise PushFieldError(field, f"{field} is missing from the push subscription")
    try:
        subject = check_name("subject", body["subject"])
    except InvalidSubjectError as exc:
        raise PushFieldError("subject", str(exc)) from None
    try:
        group = check_name("consumer group", body["group"])
    except InvalidSubjectError as exc:
        raise PushFieldError("group", str(exc)) from None
    url = check_push_url(body["url"])
    secret = body.get("secret", "")
    if not isinstance(secret, str) or len(secret) > SECRET_CHARS_MAX:
        raise PushFieldError("secret", f"secret must be a string of at most {SECRET_CHARS_MAX} characters")
    tags = body.get("tags", [])
    if not isinstance(tags, list) or len(tags) > DEFAULT_LIMITS.tags_max:
        raise PushFieldError("tags", f"tags {tags!r} must be a list of at most {DEFAULT_LIMITS.tags_max} tags")
    for tag in tags:
        try:
            check_tag(tag)
        except InvalidMessageError as exc:
            raise PushFieldError("tags", str(exc)) from None
    backoff = body.get("retry_backoff_ms", list(RETRY_BACKOFF_MS_DEFAULT))
    if (
        not isinstance(backoff, list)
        or len(backoff) > RETRY_BACKOFF_STEPS_MAX
        or not all(
            isinstance(ms, int) and not isinstance(ms, bool) and 0 <= ms <= RETRY_BACKOFF_MS_MAX for ms in backoff
        )
    ):
        raise PushFieldError(
            "retry_backoff_ms",
            f"retry_backoff_ms {backoff!r} must be a list of at most {RETRY_BACKOFF_STEPS_MAX} waits, "
            f"each a whole number of ms from 0 to {RETRY_BACKOFF_MS_MAX}",
        )
    return PushSubscription(
        subject=subject,
        group=group,
        url=url,
        concurrency=_int(body, "concurrency", CONCURRENCY_DEFAULT, 1, CONCURRENCY_MAX, "deliveries in flight"),
        rate_per_s=_int(body, "rate_per_s", 0, 0, RATE_PER_S_MAX, "deliveries per second, 0 for no bound"),
        timeout_ms=_int(
            body, "timeout_ms", TIMEOUT_MS_DEFAULT, TIMEOUT_MS_MIN, TIMEOUT_MS_MAX, "ms to wait for an answer"
        ),
        secret=secret,
        tags=tuple(sorted(set(tags))),
        tag_type=_choice(body, "tag_type", "or", TAG_TYPES),
        start_from=_choice(body, "start_from", "latest", START_FROM),
        max_retries=_int(body, "max_retries", MAX_RETRIES_DEFAULT, 0, MAX_RETRIES_MAX, "failures before dead letters"),
        retry_backoff_ms=tuple(backoff),
        created_at_ms=_int(body, "created_at_ms", 0, 0, _INT_MAX, "epoch ms"),
    )


def subscription_json(sub: PushSubscription, *, with_secret: bool) -> dict[str, Any]:
    """The JSON object of ``sub``; without its secret (``"secret": "***"`` when one is set) for listings."""
    return {
        "subject": sub.subject,
        "group": sub.group,
        "url": sub.url,
        "concurrency": sub.concurrency,
        "rate_per_s": sub.rate_per_s,
        "timeout_ms": sub.timeout_ms,
        "secret": sub.secret if with_secret or not sub.secret else "***",
        "tags": list(sub.tags),
        "tag_type": sub.tag_type,
        "start_from": sub.start_from,
        "max_retries": sub.max_retries,
        "retry_backoff_ms": list(sub.retry_backoff_ms),
        "created_at_ms": sub.created_at_ms,
    }
