"""A full disk: sends are refused DISK_FULL and /health says so until space is freed, with no
restart; a broker that cannot write its final checkpoint at shutdown exits non-zero and says why."""

from __future__ import annotations

import errno
import json
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from rawclient import RawClient, message, split_records

from qmq.protocol.codes import Status
from qmq.protocol.message import decode_message
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


def _health(http: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(f"{http}/health", timeout=10) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_a_full_disk_is_refused_shown_in_health_and_clears_by_itself(small_disk: Path, subject: str) -> None:
    data = small_disk / "broker"
    args = ["broker", "--data-dir", str(data), "--port", "0", "--http-port", "0", "--segment-bytes", "1048576"]
    args += ["--disk-free-bytes-min", "0"]
    with running_role(args) as broker:
        client = RawClient(broker.ready["address"])
        try:
            assert client.send(message(subject, "m1")).status == Status.OK
            _fill(small_disk)
            big = message(subject, "m2", b"x" * 200_000)  # more than a filled tmpfs has left
            assert client.send(big).status == Status.DISK_FULL
            status, health = _health(broker.ready["http"])
            assert (status, health["write_state"]) == (200, "disk-full")  # alive, reads go on
            assert "full" in str(health["error"])
            (small_disk / "filler").unlink()
            deadline = time.monotonic() + 10
            while (answer := client.send(big)).status == Status.DISK_FULL and time.monotonic() < deadline:
                time.sleep(0.2)  # the free-space check runs at most once a second
            assert answer.status == Status.OK, answer.header
            status, health = _health(broker.ready["http"])
            assert (status, health["write_state"]) == (200, "ok")
            got = client.pull(subject, "g")
            assert [decode_message(m).message_id for _seq, m in split_records(got.body)] == ["m1", "m2"]
        finally:
            client.close()
