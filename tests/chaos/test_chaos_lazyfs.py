"""The power-loss file system of the fault campaign (chaos/lazyfs.py), mounted for real: what
was fsynced survives the cut, what was not is undone, new entries need their directory's fsync.
Needs root, /dev/fuse and libfuse 3 (.ci/run installs fuse3)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def lazy(tmp_path: Path) -> Iterator[tuple[Path, Path, subprocess.Popen[bytes]]]:
    backing, mount = tmp_path / "backing", tmp_path / "mnt"
    backing.mkdir()
    mount.mkdir()
    root = Path(__file__).resolve().parents[2]
    proc = subprocess.Popen(
        [sys.executable, "-m", "chaos.lazyfs", str(backing), str(mount)],
        cwd=root, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 20
    try:
        while not os.path.ismount(mount):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else "lazyfs exited"
            assert time.monotonic() < deadline, "lazyfs did not mount"
            time.sleep(0.05)  # a mount gives no event; polled with a deadline
    except BaseException:
        # not mounted: its pipe is closed here, not left to the garbage collector (a
        # ResourceWarning then fails whichever later test of this worker it lands in)
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
        raise
    try:
        yield backing, mount, proc
    finally:
        subprocess.run(["fusermount3", "-u", "-z", str(mount)], capture_output=True)
        proc.wait(20)
        if proc.stdout is not None:
            proc.stdout.close()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def test_the_cut_keeps_what_was_fsynced_and_undoes_the_rest(lazy: tuple[Path, Path, subprocess.Popen[bytes]]) -> None:
    backing, mount, proc = lazy
    (mount / "log").mkdir()
    _fsync(mount)
    fd = os.open(mount / "log" / "a", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"hello ")
    os.fsync(fd)
    _fsync(mount / "log")
    os.write(fd, b"world")  # never fsynced
    os.pwrite(fd, b"J", 0)  # an overwrite, never fsynced
    os.close(fd)
    fd = os.open(mount / "log" / "b", os.O_WRONLY | os.O_CREAT, 0o644)
    os.write(fd, b"x" * 100)
    os.fsync(fd)  # its data, but not its directory entry
    os.close(fd)
    assert (mount / "log" / "a").read_bytes() == b"Jello world"  # reads see every write
    assert subprocess.run(["fusermount3", "-u", str(mount)], capture_output=True).returncode == 0
    proc.wait(20)
    assert (backing / "log" / "a").read_bytes() == b"hello "
    assert not (backing / "log" / "b").exists()
