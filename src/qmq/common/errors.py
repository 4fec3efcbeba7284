"""Every error qmq raises to a user, in one place.

Each class says whether repeating the same request may succeed (``retriable``): the
producer retries those on its own, the rest go straight back to the caller.
"""

from __future__ import annotations


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


class BrokerError(QmqError):
    """The broker answered a request with an error status."""

    def __init__(self, status: int, status_name: str, text: str, *, retriable: bool) -> None:
        self.status = status
        self.status_name = status_name
        self.retriable = retriable
        super().__init__(f"{status_name}: {text}" if text else status_name)


class ConnectionLostError(QmqError):
    """The connection to a server closed before the answer arrived."""

    retriable = True


class NoBrokerError(QmqError):
    """The meta server knows no broker group that can take the request."""

    retriable = True


class MetaServerError(QmqError):
    """The meta server could not be reached or answered with something unusable."""

    retriable = True
