"""Protocol errors (who broke the protocol) and the map from response status to exception."""

from __future__ import annotations

from qmq.common.errors import (
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


def error_for_status(status: int, text: str, outcome_unknown: bool = False) -> QmqError:
    """The exception a client raises for a non-OK response (``outcome_unknown``: see BrokerError)."""
    if status == Status.MESSAGE_TOO_LARGE:
        return MessageTooLargeError(text)
    if status == Status.INVALID_SUBJECT:
        return InvalidSubjectError(text)
    if status == Status.INVALID_MESSAGE:
        return InvalidMessageError(text)
    return BrokerError(
        status, status_name(status), text, retriable=status in RETRIABLE_STATUSES, outcome_unknown=outcome_unknown
    )
