"""How a consumer group consumes a subject: its tags, broadcast mode, retry budget and back-off.

The broker applies the tags (only matching messages are pulled) and the broadcast mode
(every consumer its own group); the SDK applies the retry budget and back-off when a
message fails: attempt ``n`` (the n-th failure) waits ``retry_backoff[n-1]`` seconds, the
last value repeating, before it is delivered again.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from qmq.client.options import check_bool, check_int
from qmq.common.errors import ConfigError, InvalidMessageError
from qmq.common.limits import DEFAULT_LIMITS
from qmq.protocol.message import check_tag

DEFAULT_RETRY_BACKOFF_S = (5, 10, 30, 60, 120, 300, 600, 1800, 3600, 7200)
_BACKOFF_S_MAX = 7 * 24 * 3600
_RETRIES_MAX = 10_000


@dataclass(frozen=True, slots=True)
class Subscription:
    tags: tuple[str, ...] = ()
    tag_type: str = "or"
    broadcast: bool = False
    max_retries: int = 16
    retry_backoff_ms: tuple[int, ...] = tuple(s * 1000 for s in DEFAULT_RETRY_BACKOFF_S)
    ordered: bool = False  # each order key's messages one at a time, retried in place (docs/ordered.md)

    def pull_header(self) -> dict[str, Any]:
        """Keys a PULL carries for this subscription (none for the plain default)."""
        header: dict[str, Any] = {"max_retries": self.max_retries}
        if self.tags:
            header["tags"] = list(self.tags)
            header["tag_type"] = self.tag_type
        if self.broadcast:
            header["broadcast"] = True
        if self.ordered:
            header["ordered"] = True
        return header

    def backoff_ms(self, attempt: int) -> int:
        """Wait before delivering a message again after its ``attempt``-th failure (1-based)."""
        if not self.retry_backoff_ms:
            return 0
        return self.retry_backoff_ms[min(max(attempt, 1), len(self.retry_backoff_ms)) - 1]


def make_subscription(
    tags: Sequence[str] | None = None,
    tag_type: str = "or",
    broadcast: bool = False,
    max_retries: int = 16,
    retry_backoff: Sequence[float] | None = None,
    ordered: bool = False,
) -> Subscription:
    """A checked Subscription; ConfigError naming the bad value."""
    if tags is None:
        tags = ()
    if isinstance(tags, str) or not all(isinstance(t, str) for t in tags):
        raise ConfigError(f"tags={tags!r} must be a list of strings, e.g. tags=['vip']")
    if len(tags) > DEFAULT_LIMITS.tags_max:
        raise ConfigError(f"tags has {len(tags)} tags; the limit is {DEFAULT_LIMITS.tags_max}")
    for tag in tags:
        try:
            check_tag(tag)
        except InvalidMessageError as exc:
            raise ConfigError(f"tags: {exc}") from None
    if tag_type not in ("or", "and"):
        raise ConfigError(f"tag_type={tag_type!r} is not allowed; use 'or' (any tag) or 'and' (all tags)")
    check_bool("broadcast", broadcast)
    check_bool("ordered", ordered)
    if ordered and tags:
        raise ConfigError(
            f"ordered=True cannot be combined with tags={list(tags)!r}: a key's messages are handed out whole; "
            "filter in the handler, or consume unordered"
        )
    check_int("max_retries", max_retries, 0, _RETRIES_MAX)
    backoff = DEFAULT_RETRY_BACKOFF_S if retry_backoff is None else tuple(retry_backoff)
    for s in backoff:
        if isinstance(s, bool) or not isinstance(s, int | float) or not 0 <= s <= _BACKOFF_S_MAX:
            raise ConfigError(
                f"retry_backoff={list(backoff)!r}: each wait must be seconds between 0 and {_BACKOFF_S_MAX}"
            )
    return Subscription(
        tuple(sorted(set(tags))), tag_type, broadcast, max_retries, tuple(round(s * 1000) for s in backoff), ordered
    )
