"""The delay server's background fsyncs: a bucket's schedule log written ``sync_bytes`` past
its last fsync is fsynced before the next checkpoint, so no checkpoint meets a burst's worth.

fsyncs are counted as they start, file by file, by the fsync spy (``fsync_spy/``) loaded into
the delay server's process; the server's metric counts them only once finished.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from delaywire import delay_group, wait_until

from qmq.aio import Producer
from qmq.testing import ReadyProcess, metric_value, running_standalone

pytestmark = pytest.mark.integration

SYNC_BYTES = 64 * 1024
SPY = Path(__file__).with_name("fsync_spy")


@contextmanager
def spied_standalone(tmp_path: Path, delay: dict[str, Any]) -> Iterator[tuple[ReadyProcess, Path]]:
    """`qmq standalone` whose processes log each fsync as it starts to the file yielded."""
    log = tmp_path / "fsyncs.log"
    log.touch()
    path = os.pathsep.join(p for p in (str(SPY), os.environ.get("PYTHONPATH")) if p)
    env = {"PYTHONPATH": path, "QMQ_TEST_FSYNC_LOG": str(log)}
    with running_standalone(tmp_path / "qmq-data", {"delay": delay}, env=env) as proc:
        yield proc, log


def _schedule_fsyncs(http: str) -> float:
    """Background fsyncs of schedule logs finished (the delay server's metric)."""
    return metric_value(http, "qmq_delay_background_syncs_total")


def _started(log: Path, schedule: Path) -> Counter[str]:
    """fsyncs started on each bucket's ``messages`` file (one per bucket per round), by bucket."""
    counts: Counter[str] = Counter()
    for line in log.read_text().splitlines():
        path = Path(line.split(" ", 1)[1])
        if path.name == "messages" and path.parent.parent == schedule:
            counts[path.parent.name] += 1
    return counts


def _schedule_dir(proc: ReadyProcess) -> Path:
    return (Path(proc.ready["data_dir"]) / "delay" / "schedule").resolve()


async def _send_delayed(meta_server: str, subject: str, chunks: int, delay_s: float) -> None:
    """``chunks`` sends one after the other, each of sync_bytes and a little more (1 KiB bodies)."""
    async with Producer(app_code="t", meta_server=meta_server) as producer:
        for _ in range(chunks):
            sends = []
            for _ in range(SYNC_BYTES // 1024 + 1):
                m = producer.generate_message(subject)
                m.body = b"x" * 1024
                m.set_delay(delay_s)
                sends.append(producer.send_nowait(m))
            await asyncio.gather(*sends)


@pytest.mark.parametrize("loaded", [True, False], ids=["bucket-loaded", "bucket-ahead"])
async def test_a_burst_into_one_bucket_is_fsynced_before_the_checkpoint(tmp_path: Path, loaded: bool) -> None:
    # a checkpoint an hour away: only the background fsyncs can make the schedule log durable
    delay = {"checkpoint_interval_ms": 3_600_000, "sync_bytes": SYNC_BYTES, "schedule_buffer_bytes_max": 65_536}
    with spied_standalone(tmp_path, delay) as (proc, log):
        http = delay_group(proc.meta_server)["http"]
        schedule = _schedule_dir(proc)
        assert _schedule_fsyncs(http) == 0
        assert not _started(log, schedule)
        subject = f"delay.{uuid.uuid4().hex[:12]}"
        # five times sync_bytes, due in the bucket now loaded (written through at once), or in a
        # bucket days ahead (buffered, written each time the buffer passes its bound)
        await _send_delayed(proc.meta_server, subject, 5, 5.0 if loaded else 3 * 86_400.0)

        def settled() -> float:
            """Finished background fsyncs once at least 3 finished and none has started since."""
            finished = _schedule_fsyncs(http)
            return finished if finished >= 3 and sum(_started(log, schedule).values()) == finished else 0

        # one fsync at a time: files written while one runs share the next
        synced = await wait_until("background fsyncs", settled, 20)
        assert synced <= 5
        assert len(_started(log, schedule)) == 1, "fsyncs of buckets the burst never went to"


async def test_sends_spread_thinly_over_many_buckets_wait_for_the_checkpoint(tmp_path: Path) -> None:
    delay = {
        "checkpoint_interval_ms": 3_600_000,
        "sync_bytes": SYNC_BYTES,
        "bucket_minutes": 5,
        "schedule_buffer_bytes_max": 65_536,  # so the sends are written to the buckets' files
    }
    with spied_standalone(tmp_path, delay) as (proc, log):
        http = delay_group(proc.meta_server)["http"]
        schedule = _schedule_dir(proc)
        subject = f"delay.{uuid.uuid4().hex[:12]}"
        async with Producer(app_code="t", meta_server=proc.meta_server) as producer:
            sends = []
            for i in range(200):  # 200 KiB over 100 five-minute buckets: 2 KiB in each
                m = producer.generate_message(subject)
                m.body = b"x" * 1024
                m.set_delay(600 + (i % 100) * 300)
                sends.append(producer.send_nowait(m))
            await asyncio.gather(*sends)

        def written() -> list[str]:
            """Buckets with records in their schedule log, once at least 128 KiB are written."""
            files = list(schedule.glob("*/messages"))
            return (
                [f.parent.name for f in files if f.stat().st_size]
                if sum(f.stat().st_size for f in files) >= 131_072
                else []
            )

        buckets = await wait_until("the buffer written to the schedule logs", written, 10)
        assert not _started(log, schedule), "a bucket written far below sync_bytes was fsynced before the checkpoint"
        assert _schedule_fsyncs(http) == 0
        assert proc.stop() == 0
    # The checkpoint at shutdown fsyncs what was written: the spy sees those.
    assert set(buckets) <= set(_started(log, schedule))
