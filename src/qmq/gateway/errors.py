"""What the gateway answers when a request cannot be served: ``{"error": {"code", "message"}}``
with an HTTP status, never a traceback.

``ApiError`` is raised by the gateway's own checks; ``api_error_of`` turns an SDK error into
one (a bad message is 400, one too large 413, a full send buffer 429, no broker 503).
"""

from __future__ import annotations

from typing import Final

from qmq.common.errors import (
    BrokerError,
    BufferFullError,
    ConfigError,
    ConnectionLostError,
    InvalidMessageError,
    InvalidSubjectError,
    MessageTooLargeError,
    MetaServerError,
    NoBrokerError,
    QmqError,
    QmqTimeoutError,
    SendError,
)

# An error message is for a person and a log line: long texts (a broker's) are cut here.
ERROR_MESSAGE_CHARS_MAX: Final = 1_000


class ApiError(Exception):
    """An answer other than 200: ``status``, a stable upper-case ``code`` and a message for people."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message[:ERROR_MESSAGE_CHARS_MAX]

    def body(self) -> dict[str, dict[str, str]]:
        return {"error": {"code": self.code, "message": self.message}}


def bad_request(code: str, message: str) -> ApiError:
    return ApiError(400, code, message)


def api_error_of(exc: QmqError) -> ApiError:
    """The answer for an error the SDK raised."""
    text = str(exc)
    if isinstance(exc, InvalidSubjectError):
        return ApiError(400, "SUBJECT_INVALID", text)
    if isinstance(exc, MessageTooLargeError):
        return ApiError(413, "MESSAGE_TOO_LARGE", text)
    if isinstance(exc, InvalidMessageError):
        return ApiError(400, "MESSAGE_INVALID", text)
    if isinstance(exc, ConfigError):
        return ApiError(400, "VALUE_INVALID", text)
    if isinstance(exc, BufferFullError):
        return ApiError(429, "THROTTLED", f"{text}; send again in a moment")
    if isinstance(exc, NoBrokerError | MetaServerError):
        return ApiError(503, "NO_BROKER", text)
    if isinstance(exc, ConnectionLostError | QmqTimeoutError):
        return ApiError(503, "BROKER_UNAVAILABLE", text)
    if isinstance(exc, BrokerError):
        if exc.status_name == "BUSY":
            return ApiError(429, "THROTTLED", text)
        return ApiError(503 if exc.retriable else 400, exc.status_name, text)
    if isinstance(exc, SendError):
        if exc.retriable:
            return ApiError(503, "SEND_FAILED", f"{text}; send again (a repeat of its message_id is dropped)")
        return ApiError(400, "SEND_REFUSED", text)
    return ApiError(503 if exc.retriable else 400, "REFUSED", text)
