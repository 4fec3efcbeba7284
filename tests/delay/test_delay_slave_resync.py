"""A delay slave back after its master deleted the write-ahead log it had not copied (real
processes): it copies the master's schedule anew and then the log, is promoted on the master's
kill -9, and nothing pending is lost, early or delivered twice."""

from __future__ import annotations

import asyncio
import os
import signal
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from delaywire import collect, now_ms
from test_delay_slaves import (
    GROUP,
    cluster_view,
    delay_args,
    delay_group_row,
    delay_server,
    meta_args,
    pending,
    replicating,
    wait_view,
)

from qmq.aio import Consumer, Producer
from qmq.testing import running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

SUBJECT = "slaves.resync"
# small segments, and at most 128 KiB kept for a slave that is away: a few hundred sends move past it
SMALL_LOG = ["--wal-segment-bytes", "65536", "--wal-kept-for-slaves-bytes-max", "131072"]
BODY = b"x" * 1000


async def _send(producer: Producer, n: int, due_at_ms: float | None, prefix: str) -> list[str]:
    futures, ids = [], []
    for i in range(n):
        m = producer.generate_message(SUBJECT)
        m.body = BODY
        m.set_property("name", f"{prefix}-{i}")
        if due_at_ms is None:
            m.set_delay(timedelta(hours=1))
        else:
            m.set_deliver_at(due_at_ms / 1000)
        ids.append(m.message_id)
        futures.append(producer.send_nowait(m))
    await asyncio.gather(*futures)
    return ids


async def test_a_slave_behind_its_masters_log_copies_anew_and_its_promotion_loses_nothing(tmp_path: Path) -> None:
    with ExitStack() as stack:
        meta = stack.enter_context(running_role(meta_args(tmp_path)))
        url = meta.meta_server
        stack.enter_context(
            running_role(["broker", "--data-dir", str(tmp_path / "b1"), "--meta-server", url, "--group", "b1",
                          "--heartbeat-interval-ms", "300"])
        )  # fmt: skip
        # the master goes on alone while its slave is away (degraded, not read-only)
        master = stack.enter_context(
            running_role([*delay_args(tmp_path / "d1-m", url, "master"), *SMALL_LOG, "--degrade-unreplicated"])
        )
        slave_args = [*delay_args(tmp_path / "d1-s", url, "slave"), *SMALL_LOG]
        slave = stack.enter_context(running_role(slave_args))
        replicating(url, slave)
        due_ms = now_ms() + 30_000  # the due-soon messages: after the promotion, before the test ends
        async with (
            Producer(app_code="t", meta_server=url) as producer,
            Consumer(app_code="t", meta_server=url, consumer_id="c1") as consumer,
        ):
            pull = consumer.pull_consumer(SUBJECT, "billing", start_from="earliest")
            soon = await _send(producer, 50, due_ms, "before")
            later = await _send(producer, 50, None, "before")
            assert await pending(slave.ready["address"]) == 100

            assert slave.stop() == 0  # the slave is away...
            soon += await _send(producer, 50, due_ms, "away")
            later += await _send(producer, 500, None, "away")  # ...while ~650 KB pass through the master
            wal = tmp_path / "d1-m" / "wal"
            for _ in range(300):  # bounded: the master checkpoints every 500 ms
                if not (wal / f"{0:020d}.log").exists():
                    break
                await asyncio.sleep(0.05)
            assert not (wal / f"{0:020d}.log").exists(), "the master kept the log its slave had not copied"

            slave = stack.enter_context(running_role(slave_args))  # back: its log ends before the master's begins
            total = await pending(master.ready["address"])
            assert total == 650

            def caught_up(v: dict[str, Any]) -> bool:
                s, m = delay_server(v, slave.ready["address"]), delay_server(v, master.ready["address"])
                return s is not None and m is not None and s["replicated_ms"] > 0 and s["log_end"] == m["log_end"]

            wait_view(url, "the slave copying anew and catching up", caught_up, timeout_s=60)
            assert await pending(slave.ready["address"]) == total
            assert not (tmp_path / "d1-s" / "resync").exists()

            os.kill(master.pid, signal.SIGKILL)
            master.proc.wait()

            def promoted(v: dict[str, Any]) -> bool:
                row = delay_group_row(v)
                return (row["master"], row["epoch"]) == (slave.ready["address"], 2)

            wait_view(url, "the slave promoted", promoted)
            got = await collect(pull, len(soon), timeout_s=60)
            assert set(got) == set(soon), f"{len(set(soon) - set(got))} of {len(soon)} due messages were lost"
            early = [i for i, at in got.items() if at < due_ms - 5]
            assert not early, f"{len(early)} messages came early"
            assert not await collect(pull, 1, timeout_s=2), "a message came twice"
            assert await pending(slave.ready["address"]) == len(later)
        view = cluster_view(url)
        assert delay_group_row(view)["group"] == GROUP
