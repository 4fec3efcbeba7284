"""What every idempotent checker shares: the interface, the outcome, the record key, the errors,
and the claim-run-record sequence of the checkers that are not transactional.

A checker's ``run(message, handler)`` returns ``Outcome.DUPLICATE`` without calling the
handler when the message's key is recorded as done; otherwise it calls the handler and
records the key only if the handler returned (a handler that raises leaves nothing
recorded, so the redelivered message runs again). ``run_async`` is the same for
``async def`` handlers.

Non-transactional checkers (memory, SQL, Redis) cannot commit the record with the
handler's own effects, so they claim the key first: a "processing" record with an owner
token and a lease. A second delivery of the same message meanwhile finds the claim and
fails with ``MessageInProgressError`` (retriable: the message comes back later and is then
skipped, or processed if the first attempt failed). A consumer that dies mid-handler
leaves a claim that expires after ``lease_ms``. A claim rather than an INSERT that simply
fails on conflict, because without a shared transaction the record must be written before
the handler runs, and a record written before is a lie if the handler then fails.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from qmq.client.options import check_identifier, check_int
from qmq.common.errors import AlreadyProcessedError, ConfigError, QmqError

log = logging.getLogger(__name__)

# What a record key may hold: it is a VARCHAR(255) primary key in the SQL tables.
RECORD_KEY_CHARS_MAX = 255
DEFAULT_TTL_MS = 86_400_000
DEFAULT_LEASE_MS = 60_000
# Loops over a claim that raced with a release (the record vanished between two reads).
CLAIM_ATTEMPTS_MAX = 3
_TTL_MS_MAX = 366 * DEFAULT_TTL_MS


class Outcome(enum.Enum):
    """What ``run`` did with a message."""

    PROCESSED = "processed"
    """The handler ran and returned; the message's key is recorded as done."""
    DUPLICATE = "duplicate"
    """The key was recorded as done already; the handler was not called."""


class MessageLike(Protocol):
    """What a checker reads of a message (``qmq.ReceivedMessage`` and ``qmq.Message`` have it)."""

    @property
    def subject(self) -> str: ...

    @property
    def message_id(self) -> str: ...


M = TypeVar("M", bound=MessageLike)
KeyFunction = Callable[[Any], str]


class IdempotentChecker(Protocol):
    """The interface a listener calls for each message (blocking SDK)."""

    def run(self, message: Any, handler: Callable[..., object]) -> Outcome: ...


class AsyncIdempotentChecker(Protocol):
    """The interface an asyncio listener awaits for each message."""

    async def run_async(self, message: Any, handler: Callable[..., Awaitable[object]]) -> Outcome: ...


class MessageInProgressError(QmqError):
    """Another consumer holds the claim on this message's key right now (retriable)."""

    retriable = True

    def __init__(self, message_id: str, key: str) -> None:
        self.message_id = message_id
        self.key = key
        super().__init__(
            f"message {message_id} (key {key!r}) is being processed by another consumer right now; this "
            "delivery fails and comes back later, when it is skipped if that processing succeeded"
        )


class DuplicateMessageError(AlreadyProcessedError):
    """``checker.transaction(message)`` found the message processed already: do nothing, acknowledge it."""

    def __init__(self, message_id: str, key: str) -> None:
        self.message_id = message_id
        self.key = key
        super().__init__(
            f"message {message_id} (key {key!r}) was processed already; catch "
            "qmq.idempotency.DuplicateMessageError around `with checker.transaction(message)` and acknowledge it"
        )


def _default_key(message: MessageLike) -> str:
    return message.message_id


class RecordKeys:
    """Turns a message into the key a checker records: ``[group/]subject/key``.

    The subject is part of it because a key function (an order id, say) may repeat across
    subjects; ``group`` keeps consumer groups that share a table or a Redis from skipping
    each other's messages. '/' cannot occur in subjects or groups, so the parts never
    blur. A key longer than 255 characters is replaced by its SHA-256.
    """

    def __init__(self, key: KeyFunction | None, group: str | None) -> None:
        if key is not None and not callable(key):
            raise ConfigError(f"key={key!r} must be a function of the message returning a string")
        self._key: KeyFunction = key or _default_key
        self._prefix = "" if group is None else check_identifier("group", group) + "/"

    def of(self, message: MessageLike) -> str:
        value = self._key(message)
        if not isinstance(value, str) or not value:
            raise ConfigError(
                f"the key function returned {value!r} for message {message.message_id}; "
                "it must return a non-empty string"
            )
        full = f"{self._prefix}{message.subject}/{value}"
        if len(full) <= RECORD_KEY_CHARS_MAX:
            return full
        return "sha256:" + hashlib.sha256(full.encode("utf-8")).hexdigest()


def check_ttl_ms(ttl_ms: object) -> int:
    return check_int("ttl_ms", ttl_ms, 1, _TTL_MS_MAX)


def check_lease_ms(lease_ms: object) -> int:
    return check_int("lease_ms", lease_ms, 1, _TTL_MS_MAX)


class Claim(enum.Enum):
    CLAIMED = "claimed"
    DONE = "done"
    BUSY = "busy"


class ClaimStore(Protocol):
    """Where a non-transactional checker keeps its records (blocking)."""

    def claim(self, key: str, token: str) -> Claim: ...

    def finish(self, key: str, token: str) -> None: ...

    def release(self, key: str, token: str) -> None: ...


class AsyncClaimStore(Protocol):
    async def claim(self, key: str, token: str) -> Claim: ...

    async def finish(self, key: str, token: str) -> None: ...

    async def release(self, key: str, token: str) -> None: ...


def new_token() -> str:
    """An owner token for one claim: which delivery holds a key."""
    return secrets.token_hex(8)


def _busy_or_duplicate(state: Claim, message: MessageLike, key: str) -> Outcome | None:
    if state is Claim.DONE:
        return Outcome.DUPLICATE
    if state is Claim.BUSY:
        raise MessageInProgressError(message.message_id, key)
    return None


def _release_failed(key: str, exc: Exception) -> None:
    log.warning("could not release the claim on %r after the handler failed (%s); it expires with its lease", key, exc)


def run_claimed(store: ClaimStore, keys: RecordKeys, message: M, handler: Callable[[M], object]) -> Outcome:
    """Claim the message's key, run ``handler``, record it done; or release the claim if it raised."""
    key = keys.of(message)
    token = new_token()
    outcome = _busy_or_duplicate(store.claim(key, token), message, key)
    if outcome is not None:
        return outcome
    try:
        handler(message)
    except BaseException:
        try:
            store.release(key, token)
        except Exception as exc:
            _release_failed(key, exc)
        raise
    store.finish(key, token)
    return Outcome.PROCESSED


async def run_claimed_async(
    store: AsyncClaimStore, keys: RecordKeys, message: M, handler: Callable[[M], Awaitable[object]]
) -> Outcome:
    """``run_claimed`` for an ``async def`` handler and a store with async methods."""
    key = keys.of(message)
    token = new_token()
    outcome = _busy_or_duplicate(await store.claim(key, token), message, key)
    if outcome is not None:
        return outcome
    try:
        await handler(message)
    except BaseException:
        try:
            await store.release(key, token)
        except Exception as exc:
            _release_failed(key, exc)
        raise
    await store.finish(key, token)
    return Outcome.PROCESSED
