"""Two delay groups behind one meta server: the producer takes them in turn, and when one dies
its sends go to the other."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from delaywire import delay_group, request

from qmq.aio import Producer
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_role

pytestmark = pytest.mark.integration


@pytest.fixture
def two_delay_groups(tmp_path: Path) -> Iterator[tuple[str, ReadyProcess, ReadyProcess]]:
    with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0"]) as meta:
        url = meta.ready["meta_server"]
        with (
            running_role(["broker", "--data-dir", str(tmp_path / "broker"), "--meta-server", url]),
            running_role(["delay", "--data-dir", str(tmp_path / "d1"), "--meta-server", url, "--group", "d1"]) as d1,
            running_role(["delay", "--data-dir", str(tmp_path / "d2"), "--meta-server", url, "--group", "d2"]) as d2,
        ):
            yield url, d1, d2


async def pending(meta_server: str, group: str) -> int:
    stats = await request(delay_group(meta_server, group)["address"], RequestCode.DELAY_STATS, {})
    return int(answer_of(stats)["pending"])


async def test_sends_take_the_delay_groups_in_turn_and_fail_over(
    two_delay_groups: tuple[str, ReadyProcess, ReadyProcess],
) -> None:
    url, d1, _d2 = two_delay_groups
    async with Producer(app_code="t", meta_server=url) as producer:
        for _ in range(20):  # one at a time: each send is its own frame, the groups take turns
            m = producer.generate_message("two.groups")
            m.set_delay(timedelta(hours=1))
            await producer.send(m)
        first = await pending(url, "d1"), await pending(url, "d2")
        assert sum(first) == 20
        assert min(first) > 0, f"one delay group took every send: {first}"
        os.kill(d1.pid, signal.SIGKILL)  # the meta server still lists it until its heartbeat times out
        d1.proc.wait()
        for _ in range(10):
            m = producer.generate_message("two.groups")
            m.set_delay(timedelta(hours=1))
            await producer.send(m)
    assert await pending(url, "d2") == first[1] + 10
