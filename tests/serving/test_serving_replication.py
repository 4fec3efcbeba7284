"""The master's side of replication alone (qmq.serving.replication.ReplicationSource): what a
write waiting for its slave is answered when that slave goes away."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any

import pytest

from qmq.protocol.codes import RequestCode
from qmq.serving.replication import ReplicationSource, caught_up
from recording import RecordingResponder

pytestmark = pytest.mark.timeout(30)


@dataclass
class Settings:
    group: str = "g"
    wait_slave_wrote: bool = True
    slave_timeout_ms: int = 50
    degrade_unreplicated: bool = False


def _source(settings: Settings) -> ReplicationSource:
    source = ReplicationSource(lambda _h: ({}, [], False), settings, lambda: (100, 0))
    source.name_slaves(["slave-1"])
    asked = {"from": 0, "action_from": 0, "timeout_ms": 0}
    source.request(RecordingResponder(), RequestCode.REPLICATE, 1, asked, "slave-1")  # it copies, then goes away
    return source


@pytest.mark.parametrize(("degrade", "answer"), [(True, None), (False, "read-only")])
def test_a_write_waiting_for_a_slave_that_went_away_is_answered_once_the_group_degrades_or_turns_read_only(
    degrade: bool, answer: str | None
) -> None:
    source = _source(Settings(degrade_unreplicated=degrade))
    answers: list[str | None] = []
    source.after_log_replicated(100, answers.append)
    assert answers == []  # the slave was fresh: the write waits for it
    time.sleep(0.1)  # past slave_timeout_ms without a request from the slave
    source.check()
    assert len(answers) == 1
    if answer is None:
        assert answers == [None]  # degraded: answered as later writes are, stored on the master alone
    else:
        assert answer in str(answers[0])


class _Logs:
    """The master's log ends, as a test moves them."""

    def __init__(self, log_end: int, action_end: int) -> None:
        self.ends = (log_end, action_end)

    def __call__(self) -> tuple[int, int]:
        return self.ends


def _replicate(source: ReplicationSource, slave: str, log_from: int, action_from: int) -> dict[str, Any]:
    conn = RecordingResponder()
    asked = {"from": log_from, "action_from": action_from, "timeout_ms": 0}
    source.request(conn, RequestCode.REPLICATE, 1, asked, slave)
    header = conn.answers[-1][2]
    assert header is not None
    return header


def test_a_slave_is_caught_up_only_once_its_copy_holds_what_the_master_held_and_answered_alone() -> None:
    logs = _Logs(100, 40)
    source = ReplicationSource(lambda _h: ({}, [], True), Settings(), logs)
    source.name_slaves([])
    answers: list[str | None] = []
    logs.ends = (150, 40)
    source.after_log_replicated(150, answers.append)  # no slave yet: answered alone
    logs.ends = (150, 55)
    source.after_actions_replicated(55, answers.append)
    assert answers == [None, None]
    # a slave joins and copies from the start: its first answers leave it catching up
    answer = _replicate(source, "slave-1", 0, 0)
    assert answer["caught_up_at"] == [150, 55]
    assert not caught_up(answer, {"from": 120, "action_from": 55})
    assert not caught_up(answer, {"from": 150, "action_from": 50})
    assert caught_up(answer, {"from": 150, "action_from": 55})
    # once named and fresh, writes wait for it and do not move the mark
    source.name_slaves(["slave-1"])
    _replicate(source, "slave-1", 150, 55)
    logs.ends = (170, 55)
    source.after_log_replicated(170, answers.append)
    assert answers == [None, None]
    assert _replicate(source, "slave-1", 170, 55)["caught_up_at"] == [150, 55]
    assert answers == [None, None, None]


def test_a_master_that_begins_an_epoch_asks_its_slaves_for_its_whole_logs_then() -> None:
    source = ReplicationSource(lambda _h: ({}, [], True), Settings(), _Logs(500, 30))
    source.reset(480, 30)  # promoted with its logs at these ends
    assert _replicate(source, "slave-2", 0, 0)["caught_up_at"] == [480, 30]


def test_a_degraded_group_marks_the_writes_it_answered_without_its_slave() -> None:
    logs = _Logs(100, 0)
    source = _source(Settings(degrade_unreplicated=True))
    source.ends = logs
    answers: list[str | None] = []
    source.after_log_replicated(130, answers.append)
    assert answers == []
    time.sleep(0.1)
    source.check()
    assert answers == [None]
    assert source.must_reach()[0] == 130


def test_an_answer_of_a_master_that_does_not_say_counts_as_caught_up() -> None:
    assert caught_up({"offset": 0}, {"from": 0, "action_from": 0})
    assert not caught_up({"caught_up_at": [1, 0]}, {"from": 0, "action_from": 0})


async def test_a_slave_that_learns_its_master_answered_writes_it_lacks_stops_reporting_itself_caught_up() -> None:
    from qmq.protocol.frame import Frame
    from qmq.serving.replication import Replicator

    copy = {"from": 100, "action_from": 10}
    answers = [
        {"caught_up_at": [100, 10]},  # holds everything its master answered
        {"caught_up_at": [180, 10]},  # the master then answered writes alone: this copy lacks them
    ]
    done = asyncio.Event()

    class Conn:
        async def request(self, code: int, header: dict[str, Any]) -> Frame:
            if not answers:
                done.set()
                await asyncio.Event().wait()  # no more answers: the test looks, then stops it
            return Frame(code, 1, answers.pop(0), response=True)

        async def close(self) -> None:
            return None

    seen: list[int] = []
    replicator = Replicator("master", 1, "me", Conn(), lambda: dict(copy), lambda _f: seen.append(replicator.last_ms))
    replicator.start()
    await asyncio.wait_for(done.wait(), 5)
    await replicator.stop()
    assert seen[1] > 0  # after the first answer was taken: caught up, so fresh
    assert replicator.last_ms == 0  # the second said otherwise: no longer to be promoted over those writes
