"""The master's side of replication alone (qmq.serving.replication.ReplicationSource): what a
write waiting for its slave is answered when that slave goes away."""

from __future__ import annotations

import time
from dataclasses import dataclass

import pytest

from qmq.protocol.codes import RequestCode
from qmq.serving.replication import ReplicationSource
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
