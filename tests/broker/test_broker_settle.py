"""SETTLE (broker/settle.py) on a real broker, below the SDK: the positions of one consumer's
pull log acked, given back (to the group's retry subject, times + 1) and held (given back when
their time passes unless settled), with each race answered in one place."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from rawclient import RawClient, broker_client, message, split_records

from qmq.common.naming import retry_subject
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import HEADER

pytestmark = [pytest.mark.integration, pytest.mark.timeout(60)]


@pytest.fixture
def client(tmp_path: Path) -> Iterator[RawClient]:
    with broker_client(tmp_path, {}) as c:
        yield c


def _settle(client: RawClient, subject: str, **fields: Any) -> dict[str, Any]:
    frame = client.call(RequestCode.SETTLE, {"subject": subject, "group": "g", "consumer_id": "c1", **fields})
    assert frame.status == Status.OK, frame.header
    return frame.header


def _pulled(client: RawClient, subject: str, **extra: Any) -> list[tuple[str, int]]:
    """(message id, times) of what one pull of consumer c1 hands out."""
    frame = client.pull(subject, "g", **extra)
    out = []
    for _seq, raw in split_records(bytes(frame.body)):
        fields = HEADER.unpack_from(raw, 0)
        id_at = HEADER.size + fields[2]
        out.append((raw[id_at : id_at + fields[3]].decode(), fields[8]))
    return out


def test_acks_and_give_backs_say_what_was_settled_before(client: RawClient) -> None:
    subject = f"settle.{uuid.uuid4().hex[:8]}"
    client.send(*(message(subject, f"m{i}") for i in range(3)))
    assert [i for i, _ in _pulled(client, subject)] == ["m0", "m1", "m2"]  # positions 0, 1, 2
    answer = _settle(client, subject, ack=[[0, 1]], give_back=[[1, 2]])
    assert (answer["settled"], answer["given_back"], answer["given_back_before"]) == ([], 1, [])
    # an ack of what was given back: settled before, and this master remembers it was given back
    answer = _settle(client, subject, ack=[[0, 2]])
    assert (answer["settled"], answer["given_back_before"]) == ([0, 1], [1])
    # a give-back of what was acked moves nothing
    assert _settle(client, subject, give_back=[[0, 1]])["given_back"] == 0
    assert _pulled(client, retry_subject(subject, "g")) == [("m1", 2)]


def test_held_positions_are_given_back_when_their_time_passes_unless_acked(client: RawClient) -> None:
    subject = f"hold.{uuid.uuid4().hex[:8]}"
    client.send(message(subject, "kept"), message(subject, "late"))
    assert [i for i, _ in _pulled(client, subject)] == ["kept", "late"]
    held_at = time.monotonic()
    assert _settle(client, subject, hold=[[0, 2]], hold_ms=1_000)["held"] is True
    assert _settle(client, subject, ack=[[0, 1]])["settled"] == []
    retry = retry_subject(subject, "g")
    got: list[tuple[str, int]] = []
    while not got and time.monotonic() - held_at < 20:
        got = _pulled(client, retry, timeout_ms=500)
    assert got == [("late", 2)]
    assert time.monotonic() - held_at >= 0.9
    # too late for the ack: the broker gave it back first
    answer = _settle(client, subject, ack=[[1, 2]])
    assert (answer["settled"], answer["given_back_before"]) == ([1], [1])


def test_a_consumer_that_never_pulled_is_refused(client: RawClient) -> None:
    subject = f"none.{uuid.uuid4().hex[:8]}"
    frame = client.call(RequestCode.SETTLE, {"subject": subject, "group": "g", "consumer_id": "c1", "ack": [[0, 1]]})
    assert frame.status == Status.BAD_REQUEST
    assert "never pulled" in frame.header["error"]
