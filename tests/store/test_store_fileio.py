"""The file-I/O seam (store/fileio.py): fault plans act on the calls their rules name, by path,
after N calls and K times, in-process or from the file a server is given (read again when it
changes); the stores' files go through it; and it costs a store nothing while no plan is on."""

from __future__ import annotations

import errno
import json
import os
import re
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import append, batch
from qmq.store import fileio
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import DiskFullError
from qmq.store.fileio import FaultPlan, FaultPlanError


@pytest.fixture(autouse=True)
def no_plan() -> Iterator[None]:
    yield
    fileio.install(None)


def _write(path: Path, data: bytes = b"x") -> None:
    fd = fileio.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        fileio.write_all(fd, data)
    finally:
        fileio.close(fd)


def test_a_rule_passes_its_first_calls_then_fails_as_many_as_it_says(tmp_path: Path) -> None:
    target, other = tmp_path / "a.bin", tmp_path / "b.dat"
    with fileio.faults({"op": "write", "path": "*.bin", "after": 2, "times": 2, "errno": "EIO"}) as plan:
        failures: list[OSError | None] = []
        for _ in range(6):
            try:
                _write(target)
                failures.append(None)
            except OSError as exc:
                failures.append(exc)
        _write(other)  # another path: never matched, never counted
    assert [f is not None for f in failures] == [False, False, True, True, False, False]
    failed = failures[2]
    assert failed is not None
    assert (failed.errno, failed.filename) == (errno.EIO, str(target))
    assert "injected by the fault plan: rule 0" in str(failed)
    assert (plan.rules[0].seen, plan.rules[0].acted) == (6, 2)
    assert target.read_bytes() == b"xxxx"  # a failed write wrote nothing
    _write(target)  # the plan is gone with the block
    assert target.read_bytes() == b"xxxxx"


def test_paths_match_by_their_end_or_whole_and_ops_by_name(tmp_path: Path) -> None:
    (tmp_path / "log").mkdir()
    seg = tmp_path / "log" / "00000000000000000000.log"
    _write(seg)
    rules = [{"op": "fsync", "path": "log/*.log", "errno": "EIO"}, {"op": "read", "path": str(seg), "errno": 28}]
    with fileio.faults(*rules):
        fd = fileio.open(seg, os.O_RDWR)
        try:
            with pytest.raises(OSError, match="rule 0") as fsync_failed:
                fileio.fdatasync(fd)
            assert fsync_failed.value.errno == errno.EIO
            with pytest.raises(OSError, match="rule 1") as read_failed:
                fileio.pread(fd, 1, 0)
            assert read_failed.value.errno == errno.ENOSPC
            fileio.write_all(fd, b"y")  # writes are not named
        finally:
            fileio.close(fd)
        fileio.fsync_dir(tmp_path / "log")  # the directory is not log/*.log


def test_a_slow_call_waits_and_then_runs(tmp_path: Path) -> None:
    with fileio.faults({"op": "fsync", "delay_ms": 50, "times": 1}) as plan:
        fd = fileio.open(tmp_path / "f", os.O_WRONLY | os.O_CREAT)
        try:
            fileio.fsync(fd)
            fileio.fsync(fd)
        finally:
            fileio.close(fd)
    assert plan.rules[0].acted == 1


@pytest.mark.parametrize(
    ("rule", "says"),
    [
        ({"op": "fsnyc", "errno": "EIO"}, "op 'fsnyc' is not one of open, read, write, fsync"),
        ({"op": "write", "errno": "EIOO"}, "errno 'EIOO' is not an errno name"),
        ({"op": "write"}, "needs errno"),
        ({"op": "write", "errno": "EIO", "times": -1}, "times -1 must be a whole number"),
        ({"op": "write", "errno": "EIO", "when": 3}, "unknown field(s) ['when']"),
    ],
)
def test_a_wrong_rule_is_refused_naming_it(rule: dict[str, object], says: str) -> None:
    with pytest.raises(ValueError, match="fault plan rule 1: ") as refused:
        FaultPlan.parse({"rules": [{"op": "read", "errno": "EIO"}, rule]})
    assert says in str(refused.value)


def test_a_server_takes_its_plan_from_the_environment_and_follows_the_file(
    tmp_path: Path, open_store: Callable[..., BrokerStore]
) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text("[]")
    fileio.from_environment({fileio.PLAN_ENV: str(plan)})
    store = open_store()
    assert append(store, batch("s", ["m1"])).stored == 1
    replacement = tmp_path / "plan.tmp"
    replacement.write_text(json.dumps([{"op": "write", "path": "log/*.log", "times": 1, "errno": "ENOSPC"}]))
    os.replace(replacement, plan)  # how the campaign starts a fault in a running server
    time.sleep(0.11)  # the file is looked at again at most every 100 ms
    with pytest.raises(DiskFullError):
        append(store, batch("s", ["m2"]))
    assert append(store, batch("s", ["m2"])).stored == 1  # "times": 1
    replacement.write_text(json.dumps([{"op": "write", "path": "log/*.log", "errno": "ENOSPC"}]))
    os.replace(replacement, plan)
    plan.unlink()  # no file: no faults, whatever it held last
    time.sleep(0.11)
    assert append(store, batch("s", ["m3"])).stored == 1
    assert store.failed is None


def test_a_bad_plan_stops_a_server_from_starting(tmp_path: Path) -> None:
    plan = tmp_path / "plan.json"
    plan.write_text('{"rules": [{"op": "write"}]}')
    with pytest.raises(FaultPlanError, match=f"{fileio.PLAN_ENV}=.*rule 0: it needs errno"):
        fileio.from_environment({fileio.PLAN_ENV: str(plan)})
    with pytest.raises(FaultPlanError, match="No such file"):
        fileio.from_environment({fileio.PLAN_ENV: str(tmp_path / "none.json")})


_FILE_CALLS = re.compile(
    r"\bos\.(open|read|pread|preadv|write|pwrite|fsync|fdatasync|sync|ftruncate|truncate|replace|rename|"
    r"unlink|remove|rmdir|mkdir|makedirs|listdir|scandir)\(|"
    r"(?<!fileio)\.(read_bytes|write_bytes|read_text|write_text|unlink|mkdir|rmdir|iterdir|glob|rename|touch|tofile)\(|"
    r"np\.fromfile|shutil\.|(?<![.\w])open\("
)


def test_the_stores_call_no_file_io_but_through_the_seam() -> None:
    """What the stores (store/, delay/) do to files, they do through fileio, so a plan reaches it all."""
    src = Path(fileio.__file__).parent.parent
    found = []
    for path in sorted([*(src / "store").glob("*.py"), *(src / "delay").glob("*.py")]):
        if path.name in ("fileio.py", "faultplan.py", "iotrace.py"):  # the seam itself
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            code = line.split("#", 1)[0]
            if _FILE_CALLS.search(code) and "def open(" not in code:
                found.append(f"{path.relative_to(src)}:{number}: {line.strip()}")
    assert found == []
