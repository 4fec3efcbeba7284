"""Segmented logs: a new segment's directory entry is made durable by the next flush, on the
flusher's thread, never by the append that rolled the log."""

from __future__ import annotations

import os
import stat
from pathlib import Path

from qmq.store.message_log import FILE_KIND
from qmq.store.segments import FlushTicket, SegmentedLog


def kinds(fds: list[int]) -> list[str]:
    return ["dir" if stat.S_ISDIR(os.fstat(fd).st_mode) else "file" for fd in fds]


def test_a_roll_leaves_the_directory_fsync_to_the_next_flush(tmp_path: Path) -> None:
    log = SegmentedLog(tmp_path / "log", ".log", 100, FILE_KIND)
    first = log.sync_fds()
    assert kinds(first) == ["dir", "file"]  # the first segment was created too
    FlushTicket(first, log.end).run()
    log.append(b"a" * 80)
    steady = log.sync_fds()
    assert kinds(steady) == ["file"]
    FlushTicket(steady, log.end).run()
    log.append(b"b" * 80)  # does not fit: a new segment
    assert len(log.segments) == 2
    rolled = log.sync_fds()
    assert kinds(rolled) == ["dir", "file", "file"]  # the directory, the rolled segment, the active one
    FlushTicket(rolled, log.end).run()
    for fd in rolled:
        try:
            os.fstat(fd)
        except OSError:
            continue
        raise AssertionError(f"fd {fd} was left open by the flush")
    assert kinds(log.sync_fds()) == ["file"]
    log.close()


def test_a_ticket_splits_in_two_parts_only_when_both_logs_have_something_to_sync(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "a", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        both = FlushTicket([os.dup(fd)], 1, None, -1, 1, [os.dup(fd)])
        assert len(both.parts()) == 2
        message_only = FlushTicket([os.dup(fd)], 1)
        assert len(message_only.parts()) == 1
        # a flush of acks and pulls alone: one part, on one thread, and it closes its descriptor
        dup = os.dup(fd)
        actions_only = FlushTicket([], 1, None, -1, 1, [dup])
        (part,) = actions_only.parts()
        part()
        try:
            os.fstat(dup)
        except OSError:
            pass
        else:
            raise AssertionError("the action log's descriptor was left open")
        for part in both.parts() + message_only.parts():
            part()
    finally:
        os.close(fd)
