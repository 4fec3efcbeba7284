"""Every error qmq raises to a user, in one place (``__all__`` lists them).

Each class says whether repeating the same request may succeed (``retriable``): the
producer retries those on its own, the rest go straight back to the caller.
"""

from __future__ import annotations

# Every error class, which ``qmq`` and ``qmq.aio`` export (the helpers below are qmq's own).
__all__ = [
    "AlreadyProcessedError",
    "AuthError",
    "BrokerError",
    "BufferFullError",
    "ConfigError",
    "ConnectionLostError",
    "DeadLetterNow",
    "InvalidMessageError",
    "InvalidSubjectError",
    "MessageTooLargeError",
    "MetaServerError",
    "NeedRetry",
    "NoBrokerError",
    "QmqError",
    "QmqTimeoutError",
    "SendError",
]


class QmqError(Exception):
    """Base of every error qmq raises on purpose."""

    retriable: bool = False


class ConfigError(QmqError, ValueError):
    """A configuration value is wrong; the message names the key, the value and what is allowed."""


class InvalidMessageError(QmqError, ValueError):
    """A message breaks a limit or a rule (subject, size, properties, tags)."""


class InvalidSubjectError(InvalidMessageError):
    """A subject (or consumer group name) is empty, too long or has a forbidden character."""


class MessageTooLargeError(InvalidMessageError):
    """The encoded message is larger than the broker accepts."""


class SendError(QmqError):
    """A message could not be stored; ``reason`` says why, ``message_id`` which message."""

    def __init__(self, reason: str, message_id: str | None = None, *, retriable: bool = False) -> None:
        self.reason = reason
        self.message_id = message_id
        self.retriable = retriable
        text = reason if message_id is None else f"message {message_id}: {reason}"
        super().__init__(text)


class BufferFullError(SendError):
    """The producer's send buffer is full: the broker is slower than the sender (back-pressure)."""

    def __init__(self, reason: str, message_id: str | None = None) -> None:
        super().__init__(reason, message_id, retriable=True)


class AuthError(QmqError):
    """A server refused the app: a wrong secret (or none), or an action it may not do.

    ``app_code``, ``action`` ("authenticate", "produce", "consume", "admin", "cluster") and
    ``subject`` (None when the action has none) say which; nothing else is told. Never retried:
    ``send``, ``pull`` and a listener's start raise it as itself.
    """

    def __init__(self, text: str, *, app_code: str = "", action: str = "", subject: str | None = None) -> None:
        self.app_code = app_code
        self.action = action
        self.subject = subject
        super().__init__(text)


class BrokerError(QmqError):
    """The broker answered a request with an error status.

    ``outcome_unknown``: the broker failed the request after it had written it (its slave never
    confirmed the copy, say), so what was asked may have taken effect. A send retried after
    such an error goes to the same broker group, whose duplicate window drops a repeat.
    """

    def __init__(
        self, status: int, status_name: str, text: str, *, retriable: bool, outcome_unknown: bool = False
    ) -> None:
        self.status = status
        self.status_name = status_name
        self.retriable = retriable
        self.outcome_unknown = outcome_unknown
        # THROTTLED: how long the broker asks to wait before sending again (0: not said)
        self.retry_after_ms = 0
        super().__init__(f"{status_name}: {text}" if text else status_name)


class ConnectionLostError(QmqError):
    """The connection to a server closed before the answer arrived.

    ``outcome_unknown`` is False when the request was never written (no connection, say): it
    cannot have taken effect. Otherwise the server may have carried it out before the
    connection went.
    """

    retriable = True

    def __init__(self, text: str, *, outcome_unknown: bool = True) -> None:
        self.outcome_unknown = outcome_unknown
        super().__init__(text)


class NoBrokerError(QmqError):
    """The meta server knows no broker group that can take the request."""

    retriable = True


class MetaServerError(QmqError):
    """The meta server could not be reached or answered with something unusable."""

    retriable = True


class NeedRetry(QmqError):
    """Raised by a handler to ask for the message again, after ``after`` (a timedelta or seconds)
    instead of the listener's back-off for this attempt."""

    def __init__(self, after: object = None, reason: str = "") -> None:
        from datetime import timedelta

        if after is None:
            self.after_ms: int | None = None
        elif isinstance(after, timedelta):
            self.after_ms = max(0, round(after.total_seconds() * 1000))
        elif isinstance(after, int | float) and not isinstance(after, bool) and after >= 0:
            self.after_ms = round(after * 1000)
        else:
            raise ConfigError(f"NeedRetry(after={after!r}): use a timedelta or a number of seconds >= 0")
        self.reason = reason
        super().__init__(reason or f"retry requested after {self.after_ms} ms")


class DeadLetterNow(QmqError):
    """A nack (or a handler's raise) that sends the message to its group's dead letters at once,
    with ``reason`` as its last error, whatever retries are left: one no attempt can handle (a
    transform that cannot evaluate it, qmq.gateway.transforms)."""

    def __init__(self, reason: str) -> None:
        self.reason = reason
        super().__init__(reason)


class QmqTimeoutError(QmqError, TimeoutError):
    """A blocking call of the SDK did not finish within its bound (the SDK's I/O thread was held
    up, by a callback that blocks, say). Also a ``TimeoutError``, so code that catches the
    builtin catches it too; repeating the call may succeed."""

    retriable = True


class AlreadyProcessedError(QmqError):
    """Raised by a handler (or an idempotent checker inside it) for a message whose work is
    done already: the listener acknowledges it instead of retrying."""


# an error text kept with a message (qmq.error) or shown in a log line, at most this long
ERROR_CHARS_MAX = 500


def printable_text(text: str) -> str:
    """``text`` as valid UTF-8 text: lone surrogates (``os.fsdecode`` of a non-UTF-8 path, say)
    become ``\\udcff``-style escapes, so it can always be stored as a property."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return text.encode("utf-8", "backslashreplace").decode("utf-8")
    return text


def error_text(exc: BaseException) -> str:
    """``Type: text`` of a handler's exception, valid UTF-8 and at most 500 characters."""
    try:
        text = f"{type(exc).__name__}: {exc}"
    except Exception:  # an exception whose __str__ itself fails
        text = f"{type(exc).__name__} (its text could not be read)"
    return printable_text(text[:ERROR_CHARS_MAX])
