"""Protocol errors (who broke the protocol) and the map from response status to exception."""

from __future__ import annotations

from typing import Any

from qmq.common.errors import (
    AuthError,
    BrokerError,
    InvalidMessageError,
    InvalidSubjectError,
    MessageTooLargeError,
    QmqError,
)
from qmq.protocol.codes import RETRIABLE_STATUSES, Status


class ProtocolError(QmqError):
    """Base of protocol violations."""


class LocalProtocolError(ProtocolError):
    """We were about to send something the protocol does not allow (a bug or a limit on our side)."""


class RemoteProtocolError(ProtocolError):
    """The peer sent bytes that are not a valid frame; the connection cannot continue."""


def status_name(status: int) -> str:
    try:
        return Status(status).name
    except ValueError:
        return f"STATUS_{status}"


AUTH_STATUSES = frozenset({Status.UNAUTHENTICATED, Status.FORBIDDEN})


def auth_error(header: dict[str, Any]) -> AuthError:
    """The AuthError of an UNAUTHENTICATED or FORBIDDEN answer, from its header's fields."""
    subject = header.get("subject")
    return AuthError(
        str(header.get("error", "")),
        app_code=str(header.get("app", "")),
        action=str(header.get("action", "")),
        subject=subject if isinstance(subject, str) else None,
    )


def error_for_status(status: int, text: str, outcome_unknown: bool = False) -> QmqError:
    """The exception a client raises for a non-OK response (``outcome_unknown``: see BrokerError)."""
    if status in AUTH_STATUSES:
        return AuthError(text)
    if status == Status.MESSAGE_TOO_LARGE:
        return MessageTooLargeError(text)
    if status == Status.INVALID_SUBJECT:
        return InvalidSubjectError(text)
    if status == Status.INVALID_MESSAGE:
        return InvalidMessageError(text)
    return BrokerError(
        status, status_name(status), text, retriable=status in RETRIABLE_STATUSES, outcome_unknown=outcome_unknown
    )
