"""What an auth file must allow for the delay server's cancel and listing: listing reads a
subject's pending messages (consume on it); a cancel names a message id and no subject, so it
is an admin's."""

from __future__ import annotations

from qmq.auth.permissions import Action
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.serving.auth_gate import needs


def test_listing_needs_consume_on_the_subject_and_cancel_needs_admin() -> None:
    listing = Frame(RequestCode.DELAY_LIST, 1, {"subject": "order.remind"})
    assert list(needs(listing)) == [(Action.CONSUME, "order.remind", None)]
    cancel = Frame(RequestCode.CANCEL_DELAY, 2, {"message_id": "m1"})
    assert list(needs(cancel)) == [(Action.ADMIN, None, None)]
