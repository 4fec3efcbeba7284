"""A failing disk under a real delay server process, through the store's fault seam
(QMQ_FAULT_PLAN, store/fileio.py): a failed fsync of the write-ahead log or of a schedule log
stops sends until a restart and loses nothing acknowledged; a full disk met by a write of the
write-ahead log is refused DISK_FULL and passes by itself; one met by a schedule log loses
nothing and the message comes when due. And the I/O trace (QMQ_IO_TRACE) shows no send
answered before the fsync of the write-ahead log that covers it."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from delayhelpers import encoded
from delaywire import collect, request

from qmq.aio import Consumer
from qmq.common.errors import BrokerError
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.store.trace_check import check_file
from qmq.testing import ReadyProcess, health, running_role

pytestmark = pytest.mark.integration

HOUR_MS = 3_600_000


@pytest.fixture(scope="module")
def meta_and_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("faults")
    with running_role(["meta", "--data-dir", str(tmp / "meta"), "--port", "0"]) as meta:
        url = meta.ready["meta_server"]
        with running_role(["broker", "--data-dir", str(tmp / "broker"), "--meta-server", url]):
            yield url


@contextmanager
def _delay(data: Path, meta_server: str, env: Mapping[str, str] | None = None) -> Iterator[ReadyProcess]:
    args = ["delay", "--data-dir", str(data), "--meta-server", meta_server, "--group", data.name]
    args += ["--checkpoint-interval-ms", "200"]
    with running_role(args, env=env) as proc:
        yield proc


def _plan(path: Path, *rules: Mapping[str, Any]) -> dict[str, str]:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(list(rules)))
    os.replace(tmp, path)  # whole, for a server that may be reading it
    return {"QMQ_FAULT_PLAN": str(path)}


def _now_ms() -> int:
    return int(time.time() * 1000)


class Answer(NamedTuple):
    status: int
    text: str
    outcome_unknown: bool


async def _send(proc: ReadyProcess, subject: str, message_id: str, due_ms: int) -> Answer:
    body = [encoded(subject, message_id, due_ms)]
    try:
        await request(proc.ready["address"], RequestCode.SEND_MESSAGES, {}, body)
    except BrokerError as exc:
        return Answer(exc.status, str(exc), exc.outcome_unknown)
    return Answer(Status.OK, "", False)


async def _stats(proc: ReadyProcess) -> dict[str, Any]:
    return answer_of(await request(proc.ready["address"], RequestCode.DELAY_STATS, {}))


async def test_a_failed_fsync_of_the_write_ahead_log_stops_sends_and_loses_nothing_acknowledged(
    tmp_path: Path, meta_and_broker: str
) -> None:
    data = tmp_path / f"d-{uuid.uuid4().hex[:8]}"
    env = _plan(tmp_path / "plan.json", {"op": "fsync", "path": "wal/*.log", "after": 3, "errno": "EIO"})
    later = _now_ms() + HOUR_MS
    with _delay(data, meta_and_broker, env) as proc:
        answers = [await _send(proc, "s", f"m{n}", later) for n in range(8)]
        acked = sum(a.status == Status.OK for a in answers)
        assert 1 <= acked < 8
        assert answers[acked].status == Status.INTERNAL_ERROR
        assert all(a.status == Status.BUSY for a in answers[acked + 1 :])  # refused unwritten: go elsewhere
        assert answers[acked].outcome_unknown  # written; whether it is kept is unknown
        assert "disk failed" in answers[-1].text
        status, body = health(proc.ready["http"])
        assert (status, body["write_state"]) == (503, "failed")
        assert "restart it" in str(body["error"])
    with _delay(data, meta_and_broker) as proc:  # no plan
        pending = (await _stats(proc))["pending"]
    assert acked <= pending <= acked + 1  # the one whose fsync failed may be kept too


async def test_a_full_disk_met_by_the_write_ahead_log_is_refused_and_passes(
    tmp_path: Path, meta_and_broker: str
) -> None:
    data = tmp_path / f"d-{uuid.uuid4().hex[:8]}"
    env = _plan(tmp_path / "plan.json", {"op": "write", "path": "wal/*.log", "after": 3, "times": 1, "errno": "ENOSPC"})
    later = _now_ms() + HOUR_MS
    with _delay(data, meta_and_broker, env) as proc:
        acked = 0
        while (answer := await _send(proc, "s", f"m{acked}", later)).status == Status.OK:
            acked += 1
            assert acked < 10
        assert answer.status == Status.DISK_FULL
        assert health(proc.ready["http"])[1]["write_state"] == "disk-full"
        deadline = time.monotonic() + 10
        while (answer := await _send(proc, "s", f"m{acked}", later)).status == Status.DISK_FULL:
            assert time.monotonic() < deadline, answer.text
            await asyncio.sleep(0.1)  # refused at once for up to a second after a write met a full disk
        assert answer.status == Status.OK, answer.text
        assert (await _stats(proc))["pending"] == acked + 1  # the refused write left nothing behind
        assert health(proc.ready["http"])[1]["write_state"] == "ok"


async def test_a_failed_fsync_of_a_schedule_log_stops_sends_and_loses_nothing_acknowledged(
    tmp_path: Path, meta_and_broker: str
) -> None:
    data = tmp_path / f"d-{uuid.uuid4().hex[:8]}"
    env = _plan(tmp_path / "plan.json", {"op": "fsync", "path": "schedule/*/messages", "errno": "EIO"})
    later = _now_ms() + HOUR_MS
    with _delay(data, meta_and_broker, env) as proc:
        assert (await _send(proc, "s", "m0", later)).status == Status.OK
        deadline = time.monotonic() + 15
        while health(proc.ready["http"])[1]["write_state"] != "failed":  # the next checkpoint fsyncs the schedule log
            assert time.monotonic() < deadline, "a failed fsync of a schedule log left the server taking sends"
            await asyncio.sleep(0.1)
        refused = await _send(proc, "s", "m1", later)
        assert refused.status == Status.BUSY
        assert "disk failed" in refused.text
    with _delay(data, meta_and_broker) as proc:  # recovery rebuilds the schedule log from the write-ahead log
        assert (await _stats(proc))["pending"] == 1


async def test_a_full_disk_met_by_a_schedule_log_loses_nothing_and_the_message_comes_when_due(
    tmp_path: Path, meta_and_broker: str
) -> None:
    data = tmp_path / f"d-{uuid.uuid4().hex[:8]}"
    plan = tmp_path / "plan.json"
    subject = f"faults.{uuid.uuid4().hex[:8]}"
    with _delay(data, meta_and_broker, _plan(plan)) as proc:
        async with Consumer(app_code="t", meta_server=meta_and_broker) as consumer:
            pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
            due = _now_ms() + 2_000
            assert (await _send(proc, subject, "first", due)).status == Status.OK
            deadline = time.monotonic() + 15
            while not all(b["loaded"] for b in (await _stats(proc))["buckets"]):  # loaded: written at once
                assert time.monotonic() < deadline
                await asyncio.sleep(0.05)
            _plan(plan, {"op": "write", "path": "schedule/*/messages", "times": 1, "errno": "ENOSPC"})
            await asyncio.sleep(0.15)  # the server looks at the plan's file at most every 100 ms
            sent = await _send(proc, subject, "second", due)
            assert sent.status == Status.OK, sent.text  # the write-ahead log has it
            got = await collect(pull, 2, timeout_s=15)
            assert sorted(got) == ["first", "second"]
            assert health(proc.ready["http"])[1]["write_state"] == "ok"


async def test_no_delay_send_is_answered_before_the_fsync_covering_it(tmp_path: Path, meta_and_broker: str) -> None:
    trace = tmp_path / "trace"
    data = tmp_path / f"d-{uuid.uuid4().hex[:8]}"
    later = _now_ms() + HOUR_MS
    with _delay(data, meta_and_broker, {"QMQ_IO_TRACE": str(trace)}) as proc:
        answers = await asyncio.gather(*(_send(proc, "s", f"m{n}", later) for n in range(100)))
        assert all(a.status == Status.OK for a in answers)
    report = check_file(trace)
    assert report.violations == [], report.summary()
    assert report.answers == 100
