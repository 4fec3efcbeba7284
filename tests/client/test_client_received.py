"""Parsing a PULL response body into received messages, and what ack records."""

from __future__ import annotations

import pytest

from qmq.client.acks import AckTracker
from qmq.client.message import Message
from qmq.client.received import Batch, ReceivedMessage, parse_records, parse_runs
from qmq.protocol.errors import RemoteProtocolError
from qmq.protocol.message import decode_message, with_times
from qmq.protocol.record import record_header


def _record(message: bytes, sequence: int, stored_ms: int = 1_700_000_000_123) -> bytes:
    return record_header(message, sequence, stored_ms) + message


def _messages(n: int) -> list[Message]:
    out = []
    for i in range(n):
        m = Message("order.paid", body=f"body-{i}".encode())
        m.set_property("i", i)
        if i % 2:
            m.add_tag("odd")
        out.append(m)
    return out


def _parse(body: bytes, runs: object, check_crc: bool = True) -> tuple[Batch, AckTracker]:
    tracker = AckTracker("broker-1", "order.paid", "billing", "order.paid")
    batch = Batch()
    parse_records(body, parse_runs(runs), "order.paid", tracker, batch, ReceivedMessage, check_crc)
    return batch, tracker


def test_records_become_messages_with_their_pull_offsets() -> None:
    sent = _messages(5)
    body = b"".join(_record(m.encode(), 100 + i) for i, m in enumerate(sent))
    batch, _ = _parse(body, [[7, 2], [20, 3]])
    assert [m.pull_offset for m in batch] == [7, 8, 20, 21, 22]
    for m, s in zip(batch, sent, strict=True):
        assert m.subject == "order.paid"
        assert m.message_id == s.message_id
        assert m.body == s.body
        assert m.get_property("i") == s.get_property("i")
        assert m.properties == dict(s.properties)
        assert m.tags == s.tags
        assert m.times == 1
        assert m.created_ms == s.created_ms
        assert m.created_at == s.created_at
        assert m.stored_at.year == 2023
        assert m.encoded == s.encode()
    assert [m.sequence for m in batch] == [100, 101, 102, 103, 104]


def test_times_is_the_attempt_on_the_wire_and_a_first_send_is_1() -> None:
    assert decode_message(Message("order.paid").encode()).times == 1
    encoded = with_times(Message("order.paid").encode(), 3)
    batch, _ = _parse(_record(encoded, 0), [[0, 1]])
    assert batch[0].times == 3
    older = with_times(Message("order.paid").encode(), 0)  # what producers before 0.2 wrote
    batch, _ = _parse(_record(older, 0), [[0, 1]])
    assert batch[0].times == 1


def test_empty_body_with_no_runs_is_an_empty_batch() -> None:
    batch, _ = _parse(b"", [])
    assert batch == []


@pytest.mark.parametrize(
    ("mutate", "runs", "match"),
    [
        (lambda b: b[:-1], [[0, 2]], "malformed"),
        (lambda b: b + b"\x00", [[0, 2]], "after the records"),
        (lambda b: b, [[0, 3]], "inside the headers"),
        (lambda b: b[:40] + bytes([b[40] ^ 1]) + b[41:], [[0, 2]], "CRC32C"),
        (lambda b: b"\x00" * 4 + b[4:], [[0, 2]], "magic"),
    ],
)
def test_a_damaged_body_raises_remote_protocol_error(mutate: object, runs: object, match: str) -> None:
    body = b"".join(_record(m.encode(), i) for i, m in enumerate(_messages(2)))
    with pytest.raises(RemoteProtocolError, match=match):
        _parse(mutate(body), runs)  # type: ignore[operator]


@pytest.mark.parametrize("runs", [None, [[1]], [["a", 1]], [[0, -1]], [[True, 1]], "x"])
def test_malformed_runs_are_refused(runs: object) -> None:
    with pytest.raises(RemoteProtocolError, match="run"):
        parse_runs(runs)


async def test_ack_records_the_offset_once_and_is_awaitable() -> None:
    body = b"".join(_record(m.encode(), i) for i, m in enumerate(_messages(3)))
    batch, tracker = _parse(body, [[10, 3]])
    await batch[2].ack()
    batch[2].ack()
    batch[0].ack()
    assert batch[0].settled
    assert tracker.take() == [[10, 11], [12, 13]]
    await batch.ack_all()  # only what was not acknowledged yet
    assert tracker.take() == [[11, 12]]
    assert all(m.settled for m in batch)


async def test_a_nack_whose_retry_copy_was_not_stored_leaves_the_message_unsettled() -> None:
    calls: list[str] = []

    async def on_nack(m: object, exc: BaseException | None) -> None:
        calls.append(str(exc))
        if len(calls) == 1:
            raise ConnectionError("no broker took the retry copy")

    sent = _messages(1)
    tracker = AckTracker("broker-1", "order.paid", "billing", "order.paid", on_nack)
    batch = Batch()
    parse_records(_record(sent[0].encode(), 1), [(0, 1)], "order.paid", tracker, batch, ReceivedMessage)
    [m] = batch
    with pytest.raises(ConnectionError):
        await m.nack(RuntimeError("first"))
    assert not m.settled  # it can be failed again, or acked
    await m.nack(RuntimeError("second"))
    assert m.settled
    assert calls == ["first", "second"]
    await m.nack(RuntimeError("third"))  # settled: nothing more
    assert calls == ["first", "second"]
