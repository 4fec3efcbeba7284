"""Bad input to a message is refused where it is set, with InvalidMessageError naming the value."""

from __future__ import annotations

from typing import Any

import pytest

from qmq import InvalidMessageError, InvalidSubjectError, MessageTooLargeError
from qmq.client.message import Message
from qmq.common.limits import DEFAULT_LIMITS, MiB

SURROGATE = "a\udcffb"


@pytest.mark.parametrize(
    ("setter", "args"),
    [
        ("set_property", ("k", SURROGATE)),
        ("set_property", (SURROGATE, "v")),
        ("add_tag", (SURROGATE,)),
    ],
)
def test_lone_surrogates_are_refused_where_they_are_set(setter: str, args: tuple[Any, ...]) -> None:
    m = Message("orders.paid")
    with pytest.raises(InvalidMessageError, match="lone surrogate"):
        getattr(m, setter)(*args)


def test_a_surrogate_in_a_body_or_id_is_refused_when_set() -> None:
    m = Message("orders.paid")
    with pytest.raises(InvalidMessageError, match=r"message body holds '\\udcff' at position 1"):
        m.body = SURROGATE
    with pytest.raises(InvalidMessageError, match="lone surrogate"):
        Message("orders.paid", message_id=SURROGATE)


@pytest.mark.parametrize("subject", ["orders\udcff", "orders\u200bpaid", "orders\u202epaid", "orders\u2060paid"])
def test_invisible_characters_in_a_subject_are_refused(subject: str) -> None:
    with pytest.raises(InvalidSubjectError, match=r"U\+[0-9A-F]{4}"):
        Message(subject)


def test_visible_non_ascii_subjects_are_fine() -> None:
    assert Message("订单.支付").subject == "订单.支付"


@pytest.mark.parametrize("delay", [10**400, -(10**400), 1e300, float("inf")])
def test_an_absurd_delay_is_refused_not_overflowed(delay: float) -> None:
    m = Message("orders.paid")
    with pytest.raises(InvalidMessageError, match=r"finite number of seconds|after the year 9999"):
        m.set_delay(delay)
    with pytest.raises(InvalidMessageError, match=r"finite number of seconds|after the year 9999"):
        m.set_deliver_at(delay)


def test_a_body_of_exactly_4_mib_encodes_within_the_message_limit() -> None:
    m = Message("orders.paid")
    m.body = b"x" * (4 * MiB)
    for i in range(20):
        m.set_property(f"key{i}", "v" * 100)
    assert len(m.encode()) <= DEFAULT_LIMITS.message_bytes_max
    with pytest.raises(MessageTooLargeError, match="body_bytes_max"):
        m.body = b"x" * (4 * MiB + 1)
