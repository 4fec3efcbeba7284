"""Deferred replies are isolated: one that fails to encode, or raises, fails its own request only,
and the group commit and the replication source go on answering the others."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest

from qmq.broker.replication import ReplicationSource
from qmq.common.config import BrokerConfig
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.errors import LocalProtocolError
from qmq.serving.group_commit import GroupCommit
from qmq.serving.replies import Reply, guarded
from qmq.store.segments import FlushTicket
from recording import RecordingResponder


class TooLarge(RecordingResponder):
    """Answers like a connection whose encoder refuses one request's answer."""

    def __init__(self, refused_id: int) -> None:
        super().__init__()
        self.refused_id = refused_id

    def respond(self, code: int, request_id: int, header: dict[str, Any] | None, *args: Any, **kw: Any) -> None:
        if request_id == self.refused_id and header is not None and "error" not in header:
            raise LocalProtocolError("frame header of 408013 bytes exceeds frame_header_bytes_max 65536")
        super().respond(code, request_id, header, *args, **kw)


def answering(conn: RecordingResponder, request_id: int) -> Reply:
    def reply(error: str | None) -> None:
        conn.respond(RequestCode.SEND_MESSAGES, request_id, {"stored": request_id, "error_was": error})

    return guarded(conn, RequestCode.SEND_MESSAGES, request_id, reply)


async def answered(conn: RecordingResponder, count: int) -> list[tuple[int, int]]:
    """(request id, status) of the answers, once there are ``count`` (or after 2 s)."""
    for _ in range(200):
        if len(conn.answers) >= count:
            break
        await asyncio.sleep(0.01)  # the flush runs on its task
    return [(a[1], a[3]) for a in conn.answers]


def group_commit() -> tuple[GroupCommit, list[int]]:
    end = [0]
    gc = GroupCommit("the test log", lambda: FlushTicket([], end[0]), lambda _t: None, lambda _s: None, lambda _e: None)
    return gc, end


async def test_a_reply_that_cannot_be_encoded_fails_its_request_and_the_others_are_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    conn = TooLarge(refused_id=2)
    gc, end = group_commit()
    try:
        end[0] = 30
        for request_id, offset in ((1, 10), (2, 20), (3, 30)):
            gc.after_write(offset, answering(conn, request_id))
        with caplog.at_level(logging.ERROR):
            assert await answered(conn, 3) == [(1, Status.OK), (2, Status.INTERNAL_ERROR), (3, Status.OK)]
        text = conn.answers[1][2]
        assert text == {
            "error": "internal error: LocalProtocolError: frame header of 408013 bytes exceeds "
            "frame_header_bytes_max 65536"
        }
        assert "SEND_MESSAGES failed" in caplog.text
        # the flush task lives on: a later write is answered
        end[0] = 40
        gc.after_write(40, answering(conn, 4))
        assert (await answered(conn, 4))[-1] == (4, Status.OK)
    finally:
        await gc.stop()


async def test_a_reply_that_raises_unguarded_is_logged_and_the_loop_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    conn = RecordingResponder()
    gc, end = group_commit()

    def broken(_error: str | None) -> None:
        raise RuntimeError("a bug in a reply")

    try:
        end[0] = 20
        gc.after_write(10, broken)
        gc.after_write(20, answering(conn, 2))
        with caplog.at_level(logging.ERROR):
            assert await answered(conn, 1) == [(2, Status.OK)]
        assert "a deferred reply failed" in caplog.text
        end[0] = 30
        gc.after_write(30, answering(conn, 3))
        assert await answered(conn, 2) == [(2, Status.OK), (3, Status.OK)]
    finally:
        await gc.stop()


def test_the_replication_source_releases_every_waiter_past_one_that_fails(tmp_path: Any) -> None:
    config = BrokerConfig(data_dir=tmp_path, wait_slave_wrote=True)
    source = ReplicationSource(lambda: None, config)  # type: ignore[arg-type, return-value]
    source.slaves_reported = 1
    source.name_slaves(["slave-1"])
    source._seen("slave-1", 0, 0)  # a fresh slave: sends wait for it
    conn = TooLarge(refused_id=2)
    for request_id in (1, 2, 3):
        source.after_log_replicated(request_id * 10, answering(conn, request_id))
    assert conn.answers == []
    source._seen("slave-1", 30, 0)
    assert [(a[1], a[3]) for a in conn.answers] == [(1, Status.OK), (2, Status.INTERNAL_ERROR), (3, Status.OK)]
