"""A broker that cannot write its final checkpoint at shutdown exits non-zero and says why."""

from __future__ import annotations

import errno
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from rawclient import RawClient, message

from qmq.protocol.codes import Status
from qmq.serving.runner import EXIT_STOP_FAILED
from qmq.testing import running_role

pytestmark = pytest.mark.integration


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """An 8 MiB tmpfs: a real disk that fills up (mounting needs root, which tests run as)."""
    mount_point = tmp_path / "disk"
    mount_point.mkdir()
    mount = ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)]
    done = subprocess.run(mount, capture_output=True, text=True, check=False)
    assert done.returncode == 0, f"cannot mount a tmpfs (the test needs root): {done.stderr}"
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def _fill(directory: Path) -> None:
    """Write zeros until the disk is full."""
    chunk = b"\0" * 65536
    with open(directory / "filler", "wb") as f:
        while True:
            try:
                f.write(chunk)
                f.flush()
            except OSError as exc:
                if exc.errno == errno.ENOSPC:
                    return
                raise


def test_a_failed_final_checkpoint_exits_non_zero(small_disk: Path, subject: str) -> None:
    data = small_disk / "broker"
    args = ["broker", "--data-dir", str(data), "--port", "0", "--http-port", "0", "--segment-bytes", "1048576"]
    args += ["--disk-free-bytes-min", "0"]
    with running_role(args) as broker:
        client = RawClient(broker.ready["address"])
        try:
            assert client.send(message(subject, "before-the-disk-filled")).status == Status.OK
        finally:
            client.close()
        _fill(small_disk)
        code = broker.stop()
        err = broker.proc.stderr.read().decode() if broker.proc.stderr else ""
    assert code == EXIT_STOP_FAILED, err
