"""What each request code needs its app to be allowed (qmq.serving.auth_gate.needs): every code
of the protocol is mapped, and a code the gate does not know needs admin."""

from __future__ import annotations

import pytest

from qmq.auth.permissions import Action
from qmq.protocol.codes import RequestCode
from qmq.protocol.frame import Frame
from qmq.serving.auth_gate import needs

S, G = "order.paid", "billing"
EXPECTED: dict[RequestCode, list[tuple[Action, str | None, str | None]]] = {
    RequestCode.PING: [],
    RequestCode.SEND_MESSAGES: [],  # per subject of the body, by the handlers
    RequestCode.PULL: [(Action.CONSUME, S, G)],
    RequestCode.ACK: [(Action.CONSUME, S, G)],
    RequestCode.SETTLE: [(Action.CONSUME, S, G)],
    RequestCode.SUBJECTS: [],
    RequestCode.LAG: [],
    RequestCode.DELAY_STATS: [],
    RequestCode.RESET_OFFSET: [(Action.ADMIN, None, None)],
    RequestCode.DEAD_LETTERS: [(Action.CONSUME, S, G)],
    RequestCode.RESEND_DEAD: [(Action.ADMIN, None, None)],
    RequestCode.PURGE_DEAD: [(Action.ADMIN, None, None)],
    RequestCode.READ: [(Action.CONSUME, S, None)],
    RequestCode.REPLICATE: [(Action.CLUSTER, None, None)],
    RequestCode.ACK_MANY: [(Action.CONSUME, S, G), (Action.CONSUME, "other", "g2")],
    RequestCode.CANCEL_DELAY: [(Action.ADMIN, None, None)],
    RequestCode.DELAY_LIST: [(Action.CONSUME, S, None)],
    RequestCode.TRACE: [(Action.ADMIN, None, None)],
    RequestCode.PULL_MANY: [(Action.CONSUME, S, G), (Action.CONSUME, "third", "g3")],
}
HEADER = {
    "subject": S,
    "group": G,
    "acks": [{"subject": S, "group": G}, {"subject": "other", "group": "g2"}],
    "pulls": [{"subject": S, "group": G}, {"subject": "third", "group": "g3"}],
}


@pytest.mark.parametrize("code", [c for c in RequestCode if c not in (RequestCode.AUTH_HELLO, RequestCode.AUTH_PROOF)])
def test_every_request_code_is_mapped(code: RequestCode) -> None:
    assert code in EXPECTED, f"{code.name}: say in auth_gate.needs what it needs, then here"
    assert list(needs(Frame(code, 1, dict(HEADER)))) == EXPECTED[code]


def test_a_code_the_gate_does_not_know_needs_admin() -> None:
    assert list(needs(Frame(99, 1, {}))) == [(Action.ADMIN, None, None)]


def test_fields_of_the_wrong_type_name_nothing() -> None:
    assert list(needs(Frame(RequestCode.PULL, 1, {"subject": 5, "group": None}))) == [(Action.CONSUME, None, None)]
    assert list(needs(Frame(RequestCode.ACK_MANY, 1, {"acks": "x"}))) == []
    assert list(needs(Frame(RequestCode.PULL_MANY, 1, {"pulls": "x"}))) == []
