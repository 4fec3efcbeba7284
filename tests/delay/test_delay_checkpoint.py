"""The delay server's checkpoints: every checkpoint_interval_ms, and sooner once checkpoint_bytes
of sends came in, so a burst never leaves one large write and fsync behind."""

from __future__ import annotations

import asyncio
import uuid
from pathlib import Path

import pytest
from delaywire import wait_until

from qmq.aio import Producer
from qmq.store.checkpoint import read_checkpoint
from qmq.testing import running_standalone

pytestmark = pytest.mark.integration

CHECKPOINT_BYTES = 64 * 1024


def _checkpointed_offset(delay_dir: Path) -> int:
    state = read_checkpoint(delay_dir)
    return int(state["wal_offset"]) if state is not None else 0


async def test_a_burst_of_sends_begins_checkpoints_before_the_period_ends(tmp_path: Path) -> None:
    data_dir = tmp_path / "qmq-data"
    config = {"delay": {"checkpoint_interval_ms": 3_600_000, "checkpoint_bytes": CHECKPOINT_BYTES}}
    with running_standalone(data_dir, config) as proc:
        delay_dir = data_dir / "delay"
        assert _checkpointed_offset(delay_dir) < CHECKPOINT_BYTES
        subject = f"delay.{uuid.uuid4().hex[:12]}"
        async with Producer(app_code="t", meta_server=proc.meta_server) as producer:
            sends = []
            for _ in range(5 * CHECKPOINT_BYTES // 1024):  # 1 KiB bodies: about five times checkpoint_bytes
                m = producer.generate_message(subject)
                m.body = b"x" * 1024
                m.set_delay(3600)
                sends.append(producer.send_nowait(m))
            await asyncio.gather(*sends)
        # an hour before the periodic checkpoint: covered anyway, within checkpoint_bytes of the end
        offset = await wait_until(
            "a checkpoint begun by the sends",
            lambda: _checkpointed_offset(delay_dir) >= 3 * CHECKPOINT_BYTES and _checkpointed_offset(delay_dir),
            timeout_s=10,
        )
        assert offset >= 3 * CHECKPOINT_BYTES
