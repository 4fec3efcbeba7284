"""The delay server's background fsyncs: a bucket's schedule log written ``sync_bytes`` past
its last fsync is fsynced before the next checkpoint, so no checkpoint meets a burst's worth."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from delaywire import delay_group, wait_until

from qmq.aio import Producer
from qmq.testing import metric_value, running_standalone

pytestmark = pytest.mark.integration

SYNC_BYTES = 64 * 1024


def _schedule_fsyncs(http: str) -> float:
    return metric_value(http, "qmq_delay_background_syncs_total")


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
    with running_standalone(tmp_path / "qmq-data", {"delay": delay}) as proc:
        http = delay_group(proc.meta_server)["http"]
        assert _schedule_fsyncs(http) == 0
        subject = f"delay.{uuid.uuid4().hex[:12]}"
        # five times sync_bytes, due in the bucket now loaded (written through at once), or in a
        # bucket days ahead (buffered, written each time the buffer passes its bound)
        await _send_delayed(proc.meta_server, subject, 5, 5.0 if loaded else 3 * 86_400.0)
        # one fsync at a time: files written while one runs share the next
        synced = await wait_until(
            "background fsyncs", lambda: _schedule_fsyncs(http) >= 3 and _schedule_fsyncs(http), 10
        )
        assert synced <= 5


async def test_sends_spread_thinly_over_many_buckets_wait_for_the_checkpoint(tmp_path: Path) -> None:
    delay = {"checkpoint_interval_ms": 3_600_000, "sync_bytes": SYNC_BYTES, "bucket_minutes": 5}
    with running_standalone(tmp_path / "qmq-data", {"delay": delay}) as proc:
        http = delay_group(proc.meta_server)["http"]
        subject = f"delay.{uuid.uuid4().hex[:12]}"
        async with Producer(app_code="t", meta_server=proc.meta_server) as producer:
            sends = []
            for i in range(200):  # 200 KiB over 100 five-minute buckets: 2 KiB in each
                m = producer.generate_message(subject)
                m.body = b"x" * 1024
                m.set_delay(600 + (i % 100) * 300)
                sends.append(producer.send_nowait(m))
            await asyncio.gather(*sends)
        assert _schedule_fsyncs(http) == 0
