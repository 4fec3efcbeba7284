"""The request table and the periodic jobs every role shares, alone: what a handler's failure
is answered with, and that a failing periodic job keeps its timer."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry, Counter

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import Frame
from qmq.serving.connection import Responder
from qmq.serving.dispatch import Handler, RequestTable
from qmq.serving.periodic import Periodic
from qmq.serving.requests import BadRequest
from qmq.store.datadir import DiskFullError, StoreError, StoreFailedError
from recording import RecordingResponder


def raising(exc: Exception) -> Handler:
    def handler(_conn: Responder, _frame: Frame) -> None:
        raise exc

    return handler


@pytest.mark.parametrize(
    ("exc", "status", "text"),
    [
        (BadRequest("'max' is missing"), Status.BAD_REQUEST, "'max' is missing"),
        (DiskFullError("no space left on /data"), Status.DISK_FULL, "no space left on /data"),
        (StoreError("segment 7 is unreadable"), Status.INTERNAL_ERROR, "segment 7 is unreadable"),
        (
            StoreFailedError("the store stopped taking writes"),
            Status.BUSY,
            "the store stopped taking writes; ask again (this group's next master takes it)",
        ),
        (KeyError("gone"), Status.INTERNAL_ERROR, "internal error: KeyError: 'gone'"),
    ],
)
def test_a_failure_is_answered_by_its_kind(exc: Exception, status: Status, text: str) -> None:
    registry = CollectorRegistry()
    requests = Counter("qmq_requests", "requests by command", ["command"], registry=registry)
    table = RequestTable({RequestCode.LAG: raising(exc)}, requests, lambda code: f"no {code}")
    conn = RecordingResponder()
    table.dispatch(conn, Frame(RequestCode.LAG, 4))
    table.dispatch(conn, Frame(RequestCode.ACK, 5))
    assert conn.answers == [
        (RequestCode.LAG, 4, {"error": text}, status),
        (RequestCode.ACK, 5, {"error": "no 4"}, Status.UNKNOWN_COMMAND),
    ]
    assert registry.get_sample_value("qmq_requests_total", {"command": "LAG"}) == 1
    assert registry.get_sample_value("qmq_requests_total", {"command": "ACK"}) is None


async def test_a_failing_periodic_job_runs_again(tmp_path: Path) -> None:
    runs: list[int] = []

    async def job() -> None:
        runs.append(len(runs))
        if len(runs) == 1:
            raise StoreError(f"cannot write {tmp_path}")

    periodic = Periodic()
    periodic.every(1, job)
    for _ in range(500):
        if len(runs) >= 3:
            break
        await asyncio.sleep(0.01)
    await periodic.stop()
    assert len(runs) >= 3
