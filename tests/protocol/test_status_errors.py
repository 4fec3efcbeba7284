"""Response statuses: which exception a client raises for each, and which are retriable."""

from __future__ import annotations

import pytest

from qmq.common.errors import (
    AuthError,
    BrokerError,
    InvalidMessageError,
    InvalidSubjectError,
    MessageTooLargeError,
)
from qmq.protocol.codes import RETRIABLE_STATUSES, RequestCode, Status
from qmq.protocol.errors import AUTH_STATUSES, auth_error, error_for_status, status_name

MESSAGE_STATUSES = {
    Status.MESSAGE_TOO_LARGE: MessageTooLargeError,
    Status.INVALID_SUBJECT: InvalidSubjectError,
    Status.INVALID_MESSAGE: InvalidMessageError,
}
OTHER_REFUSALS = [
    s
    for s in Status
    if s != Status.OK and s not in RETRIABLE_STATUSES and s not in MESSAGE_STATUSES and s not in AUTH_STATUSES
]


@pytest.mark.parametrize(("status", "cls"), MESSAGE_STATUSES.items())
def test_message_statuses_map_to_message_errors(status: Status, cls: type[Exception]) -> None:
    err = error_for_status(status, "the text")

    assert type(err) is cls
    assert str(err) == "the text"
    assert not err.retriable


@pytest.mark.parametrize("status", OTHER_REFUSALS)
def test_other_refusals_are_broker_errors_that_are_not_retriable(status: Status) -> None:
    err = error_for_status(status, "why")

    assert isinstance(err, BrokerError)
    assert (err.status, err.status_name, err.retriable) == (status, status.name, False)
    assert str(err) == f"{status.name}: why"


@pytest.mark.parametrize("status", sorted(AUTH_STATUSES))
def test_auth_statuses_are_auth_errors_never_retried(status: Status) -> None:
    err = error_for_status(status, "app 'shop' may not produce to 'x'")

    assert type(err) is AuthError
    assert not err.retriable
    named = auth_error({"error": "no", "app": "shop", "action": "produce", "subject": "x"})
    assert (named.app_code, named.action, named.subject, str(named)) == ("shop", "produce", "x", "no")


@pytest.mark.parametrize("status", sorted(RETRIABLE_STATUSES))
def test_retriable_statuses_are_retriable_broker_errors(status: Status) -> None:
    err = error_for_status(status, "")

    assert isinstance(err, BrokerError)
    assert err.retriable
    assert str(err) == status.name


def test_unknown_status_has_a_readable_name() -> None:
    err = error_for_status(999, "new")

    assert status_name(999) == "STATUS_999"
    assert isinstance(err, BrokerError)
    assert str(err) == "STATUS_999: new"
    assert not err.retriable


def test_status_and_request_codes_fit_their_u16_fields() -> None:
    assert all(0 <= c <= 0xFFFF for c in [*RequestCode, *Status])
    assert int(Status.OK) == 0
    assert Status.BAD_REQUEST in OTHER_REFUSALS
