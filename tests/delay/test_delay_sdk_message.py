"""The SDK side of delay messages without a server: due times on a Message, and the CLI's
duration and time parsers."""

from __future__ import annotations

import math
import time
from datetime import UTC, datetime, timedelta, timezone

import click
import pytest

from qmq.cli.client_commands import parse_at, parse_duration_s
from qmq.client.message import Message
from qmq.common.errors import InvalidMessageError
from qmq.protocol.message import decode_message


def test_set_delay_takes_seconds_or_a_timedelta() -> None:
    m = Message("s")
    before_ms = time.time() * 1000
    m.set_delay(1.5)
    assert before_ms + 1500 <= m.deliver_at_ms <= time.time() * 1000 + 1501
    m.set_delay(timedelta(minutes=2))
    assert before_ms + 120_000 <= m.deliver_at_ms <= time.time() * 1000 + 120_001


def test_set_deliver_at_takes_an_aware_datetime_or_epoch_seconds() -> None:
    m = Message("s")
    m.set_deliver_at(datetime(2026, 12, 24, 18, 0, tzinfo=timezone(timedelta(hours=8))))
    assert m.deliver_at == datetime(2026, 12, 24, 10, 0, tzinfo=UTC)
    assert m.deliver_at_ms == 1_798_106_400_000
    m.set_deliver_at(1_700_000_000.123)
    assert m.deliver_at_ms == 1_700_000_000_123  # float noise does not add a millisecond
    m.set_deliver_at(1_700_000_000.1231)
    assert m.deliver_at_ms == 1_700_000_000_124  # never moved earlier: rounded up


def test_the_due_time_is_encoded_and_a_new_message_has_none() -> None:
    m = Message("s")
    assert m.deliver_at is None
    assert decode_message(m.encode()).deliver_at_ms == 0
    m.set_deliver_at(1_800_000_000)
    assert decode_message(m.encode()).deliver_at_ms == 1_800_000_000_000
    assert "deliver_at=2027-01-15T08:00:00+00:00" in repr(m)


def test_a_naive_datetime_is_refused_saying_to_pass_an_aware_one() -> None:
    with pytest.raises(InvalidMessageError, match="has no time zone; pass an aware datetime"):
        Message("s").set_deliver_at(datetime(2026, 12, 24, 18, 0))


@pytest.mark.parametrize("value", [math.nan, math.inf, True, "60", None])
def test_a_delay_must_be_a_finite_number(value: object) -> None:
    with pytest.raises(InvalidMessageError, match="delay"):
        Message("s").set_delay(value)  # type: ignore[arg-type]


def test_epoch_seconds_before_1970_are_refused() -> None:
    with pytest.raises(InvalidMessageError, match="before 1970"):
        Message("s").set_deliver_at(-1)


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90", 90.0), ("1.5", 1.5), ("500ms", 0.5), ("90s", 90.0), ("5m", 300.0), ("2h", 7200.0), ("1d", 86400.0)],
)
def test_durations_of_the_cli(text: str, seconds: float) -> None:
    assert parse_duration_s(text) == seconds


@pytest.mark.parametrize("text", ["", "5x", "-5s", "1h30m", "s"])
def test_bad_durations_say_what_is_accepted(text: str) -> None:
    with pytest.raises(click.BadParameter, match="90s, 5m, 2h, 1d"):
        parse_duration_s(text)


def test_times_of_the_cli_need_an_offset() -> None:
    assert parse_at("2026-12-24T18:00:00+08:00") == datetime(2026, 12, 24, 10, 0, tzinfo=UTC)
    assert parse_at("2026-12-24T10:00:00Z") == datetime(2026, 12, 24, 10, 0, tzinfo=UTC)
    with pytest.raises(click.BadParameter, match="has no UTC offset"):
        parse_at("2026-12-24T18:00:00")
    with pytest.raises(click.BadParameter, match="not an ISO 8601 time"):
        parse_at("tomorrow")
