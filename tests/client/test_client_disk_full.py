"""A full disk through the SDK: the broker's data directory on a small tmpfs, filled until it
has less free space than ``disk_free_bytes_min``, or none at all. Sends are refused with
DISK_FULL, which the producer retries until ``send_timeout_ms`` and then raises as a
``SendError`` naming it; nothing acknowledged is lost, and once space is freed a send still
being retried is stored and new sends work. Needs root (mount)."""

from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from qmq import SendError
from qmq.aio import Consumer, Producer
from qmq.common.limits import MiB
from qmq.testing import running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.slow]

DISK_BYTES = 16 * MiB
FREE_BYTES_MIN = 4 * MiB  # the broker's disk_free_bytes_min
LEFT_FREE_BYTES = 2 * MiB  # what the filler leaves: below the minimum, well above what sends need
# Small messages: the broker looks at its free space once a second, and sends taken meanwhile
# must not fill the 2 MiB left (some 3,000 sends a second on tmpfs, of 150 bytes each stored).
BODY = b"x" * 64
FULL_TIMEOUT_S = 15.0


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 16 MiB tmpfs mounted where `qmq standalone --data-dir tmp_path/qmq-data` keeps the broker's files."""
    mount_point = tmp_path / "qmq-data" / "broker"
    mount_point.mkdir(parents=True)
    done = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, f"cannot mount a tmpfs (the test needs root): {done.stderr}"
    try:
        yield mount_point
    finally:
        if subprocess.run(["umount", str(mount_point)], capture_output=True, check=False).returncode:
            subprocess.run(["umount", "--lazy", str(mount_point)], check=True)


def _fill(disk: Path, left_bytes: int) -> Path:
    """A file taking all the disk's free space but ``left_bytes``."""
    st = os.statvfs(disk)
    size = st.f_bavail * st.f_frsize - left_bytes
    filler = disk / "filler"
    chunk = b"\0" * MiB
    with open(filler, "wb", buffering=0) as fh:
        try:
            while size > 0:
                size -= fh.write(chunk[: min(size, len(chunk))])
        except OSError as exc:  # full before the count: the file system's own use of its space
            if exc.errno != errno.ENOSPC:
                raise
    return filler


async def test_a_disk_below_its_free_space_minimum_refuses_sends_until_freed(small_disk: Path) -> None:
    """Less free space than disk_free_bytes_min: refused before anything is written, however
    small the send, so a send made meanwhile is retried until the space is freed."""
    config = {"broker": {"disk_free_bytes_min": FREE_BYTES_MIN}}
    with running_standalone(small_disk.parent, config) as proc:
        url = proc.meta_server
        subject = f"disk.{uuid.uuid4().hex[:8]}"
        acked, refused, filler = await _fill_and_send_until_refused(
            url, subject, small_disk, LEFT_FREE_BYTES, "disk_free_bytes_min"
        )
        async with Producer(app_code="t", meta_server=url, send_timeout_ms=30_000, retry_backoff_ms=50) as patient:
            waiting = patient.generate_message(subject)
            sending = patient.send_nowait(waiting)
            async with asyncio.timeout(FULL_TIMEOUT_S):
                while True:  # until refused and retried while the disk is full
                    if patient.stats.retries >= 2:
                        break
                    await asyncio.sleep(0.05)  # polling the producer's counter, bounded by the timeout
            assert not sending.done()
            filler.unlink()
            await sending  # stored once the broker sees the space, within the send's timeout
            acked.append(waiting.message_id)
            await _send_again_and_read_back(patient, url, subject, acked, refused)


async def test_a_disk_with_no_space_left_refuses_sends_until_freed(small_disk: Path) -> None:
    """No free-space minimum, a disk filled to the last byte: the broker's write fails
    (ENOSPC, or a short write) and the send is refused as DISK_FULL all the same."""
    with running_standalone(small_disk.parent, {"broker": {"disk_free_bytes_min": 0}}) as proc:
        url = proc.meta_server
        subject = f"disk.{uuid.uuid4().hex[:8]}"
        acked, refused, filler = await _fill_and_send_until_refused(url, subject, small_disk, 0, "is full")
        filler.unlink()
        async with Producer(app_code="t", meta_server=url) as producer:
            await _send_again_and_read_back(producer, url, subject, acked, refused)


async def _fill_and_send_until_refused(
    url: str, subject: str, disk: Path, left_bytes: int, why: str
) -> tuple[list[str], SendError, Path]:
    """Send 20 messages, fill the disk to ``left_bytes`` free, and send until one raises a
    SendError naming DISK_FULL and ``why`` after retries; (ids acknowledged, that error, the filler)."""
    acked: list[str] = []
    async with Producer(app_code="t", meta_server=url, send_timeout_ms=1_500, retry_backoff_ms=50) as producer:
        for _ in range(20):
            m = producer.generate_message(subject)
            m.body = BODY
            await producer.send(m)
            acked.append(m.message_id)
        filler = _fill(disk, left_bytes)
        # The broker looks at its free space at most once a second: send until it refuses.
        deadline = time.monotonic() + FULL_TIMEOUT_S
        retries_before = producer.stats.retries
        while True:
            assert time.monotonic() < deadline, f"no send was refused within {FULL_TIMEOUT_S} s of the disk filling"
            m = producer.generate_message(subject)
            m.body = BODY
            try:
                await producer.send(m)
            except SendError as exc:
                refused = exc
                break
            acked.append(m.message_id)
    assert "DISK_FULL" in str(refused)
    assert why in str(refused)
    assert refused.retriable
    assert refused.message_id == m.message_id
    assert producer.stats.retries > retries_before, "the producer raised without retrying"
    return acked, refused, filler


async def _send_again_and_read_back(
    producer: Producer, url: str, subject: str, acked: list[str], refused: SendError
) -> None:
    """Once space is freed: a send works, and a new group reads every acknowledged send once
    and the refused one not at all."""
    after = producer.generate_message(subject)
    await producer.send(after)
    acked.append(after.message_id)
    async with Consumer(app_code="audit", meta_server=url) as consumer:
        pull = consumer.pull_consumer(subject, "audit", start_from="earliest")
        got: list[str] = []
        async with asyncio.timeout(30):
            while after.message_id not in got:
                batch = await pull.pull(max_messages=500, timeout_ms=500)
                batch.ack_all()
                got.extend(m.message_id for m in batch)
    assert Counter(got) == Counter(acked), "acknowledged sends lost or stored twice"
    assert refused.message_id not in got, "a send refused with DISK_FULL was stored"
