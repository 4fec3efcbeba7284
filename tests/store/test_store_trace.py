"""The I/O trace (store/fileio.py) and its checker (store/trace_check.py): the checker finds an
answer that came before the fsync covering it, or before its new file was durable in its
directory, and passes a store whose answers wait for their flush; the trace stops at its cap."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from conftest import append, batch, flush
from qmq.store import fileio
from qmq.store.broker_store import BrokerStore
from qmq.store.trace_check import check, check_file, main, parse

SEG = "/d/log/00000000000000000000.log"


@pytest.fixture
def trace(tmp_path: Path) -> Iterator[Path]:
    path = tmp_path / "trace"
    fileio.start_trace(path)
    yield path
    fileio.stop_trace()


def _lines(*events: tuple[object, ...]) -> list[str]:
    return ["# qmq io trace 1 pid=7\n", *("\t".join(str(f) for f in e) + "\n" for e in events)]


def test_answers_after_the_fsync_covering_them_pass() -> None:
    report = check(
        parse(
            _lines(
                ("sync", 7, "fdatasync", 100, 200, 300, SEG),
                ("answer", 7, 250, 300, 284, SEG),
                ("sync", 7, "fdatasync", 300, 400, 500, SEG),
                ("answer", 7, 401, 450, 434, SEG),
                ("answer", 7, 402, 500, 484, SEG),
                ("sync", 7, "fdatasync", 100, 500, 9999, "/d/log/00000000000000099999.log"),  # another file
            )
        )
    )
    assert (report.answers, report.syncs, report.violations) == (3, 3, [])


@pytest.mark.parametrize(
    ("events", "reason"),
    [
        # answered while its fsync ran
        ([("sync", 7, "fdatasync", 100, 200, 300, SEG), ("answer", 7, 150, 300, 284, SEG)], "no fsync of the file"),
        # answered after an fsync that began before the send's bytes were written
        (
            [("sync", 7, "fdatasync", 100, 200, 300, SEG), ("answer", 7, 250, 400, 384, SEG)],
            "covered 300 bytes of the file, not 400",
        ),
        # a failed fsync covers nothing
        ([("failed", 7, "fdatasync", 100, 200, "EIO", SEG), ("answer", 7, 250, 300, 284, SEG)], "no fsync"),
        # a new segment, fsynced, but its directory entry never was
        (
            [("create", 7, 50, SEG), ("sync", 7, "fdatasync", 100, 200, 300, SEG), ("answer", 7, 250, 300, 284, SEG)],
            f"{SEG} was made at 50 ns and no fsync of /d/log",
        ),
        # the directory's fsync began before the file was made
        (
            [
                ("sync", 7, "dirsync", 40, 60, "-", "/d/log"),
                ("create", 7, 50, SEG),
                ("sync", 7, "fdatasync", 100, 200, 300, SEG),
                ("answer", 7, 250, 300, 284, SEG),
            ],
            "no fsync of /d/log made it durable",
        ),
        # the fsync was of the file that had that name before it was made again (a log cut back)
        (
            [
                ("sync", 7, "fdatasync", 10, 20, 300, SEG),
                ("create", 7, 50, SEG),
                ("sync", 7, "dirsync", 60, 70, "-", "/d/log"),
                ("answer", 7, 250, 300, 284, SEG),
            ],
            "no fsync of the file",
        ),
    ],
)
def test_an_answer_before_it_was_durable_is_found(events: list[tuple[object, ...]], reason: str) -> None:
    [violation] = check(parse(_lines(*events))).violations
    assert reason in violation.reason
    assert SEG in str(violation)


def test_a_new_segment_made_durable_in_its_directory_passes() -> None:
    events = [
        ("create", 7, 50, SEG),
        ("sync", 7, "dirsync", 60, 70, "-", "/d/log"),
        ("sync", 7, "fdatasync", 100, 200, 300, SEG),
        ("answer", 7, 250, 300, 284, SEG),
    ]
    assert check(parse(_lines(*events))).violations == []


def test_a_store_that_answers_after_its_flush_passes_and_one_that_answers_before_does_not(
    open_store: Callable[..., BrokerStore], trace: Path
) -> None:
    store = open_store()
    for n in range(5):
        append(store, batch("s", [f"m{n}", f"n{n}"]))
        flush(store)
        fileio.trace_answer(store.mlog.segments, store.mlog.end)  # where the broker answers
    append(store, batch("s", ["early"]))
    fileio.trace_answer(store.mlog.segments, store.mlog.end)  # before its flush
    flush(store)
    fileio.stop_trace()
    report = check_file(trace)
    assert report.answers == 6
    [violation] = report.violations
    assert violation.answer.offset == store.mlog.end
    assert main([str(trace)]) == 1


def test_the_trace_stops_at_its_cap_and_says_so(tmp_path: Path, open_store: Callable[..., BrokerStore]) -> None:
    path = tmp_path / "trace"
    fileio.start_trace(path, bytes_max=4096)
    try:
        store = open_store()
        for n in range(100):
            append(store, batch("s", [f"m{n}"]))
            flush(store)
    finally:
        fileio.stop_trace()
    assert path.stat().st_size <= 4096
    lines = path.read_text().splitlines()
    assert lines[-1].startswith("# stopped: 4096 bytes, QMQ_IO_TRACE_BYTES_MAX")
    report = check_file(path)
    assert report.stopped
    assert report.syncs > 0
