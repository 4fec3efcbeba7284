"""Open files stay within open_files_max whatever the number of subjects, checkpoints
included; running out of descriptors passes once some are free again."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_store_send_pull import records

from conftest import append, batch, checkpoint, flush
from qmq.store.broker_store import BrokerStore
from qmq.store.open_files import OpenFiles
from qmq.store.segments import Segment

FILES_MAX = 16
SUBJECTS = 300


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_many_subjects_keep_open_files_within_the_bound(open_store: Callable[..., BrokerStore]) -> None:
    before = open_fds()
    store = open_store(open_files_max=FILES_MAX, consume_log_segment_entries=1024)
    for n in range(0, SUBJECTS, 50):
        append(store, b"".join(batch(f"s{i}", [f"m{i}"]) for i in range(n, n + 50)))
    flush(store)
    bound = before + FILES_MAX + 10  # the message log, the action log and the directories they fsync
    assert open_fds() <= bound
    ticket = store.begin_flush(consume_logs=True)
    assert open_fds() <= bound  # a checkpoint opens nothing per subject
    assert ticket.syncfs_fd >= 0  # one syncfs makes the consume logs durable, closed ones included
    store.write_checkpoint(ticket, store.checkpoint_state())
    for i in range(SUBJECTS):
        gp = store.group(f"s{i}", "g", "earliest")
        got = store.pull(gp, gp.consumer("c"), "x", 10)
        assert got is not None
        assert records(got) == [(0, f"m{i}")]
        store.ack(gp, gp.consumer("c"), [[0, 1]])
    assert open_fds() <= bound
    checkpoint(store)
    store.close()

    again = open_store(open_files_max=FILES_MAX, consume_log_segment_entries=1024)
    assert open_fds() <= bound
    assert len(again.subjects) == SUBJECTS
    append(again, b"".join(batch(f"s{i}", [f"again{i}"]) for i in range(SUBJECTS)))
    flush(again)
    for i in range(0, SUBJECTS, 7):
        gp = again.progress.get(f"s{i}", "g")
        assert gp is not None
        got = again.pull(gp, gp.consumers["c"], "y", 10)
        assert got is not None
        assert records(got) == [(1, f"again{i}")]
    assert open_fds() <= bound


def test_a_full_descriptor_table_sheds_open_files_and_tries_again(tmp_path: Path) -> None:
    files = OpenFiles(8)
    segs = []
    for i in range(6):
        path = tmp_path / f"{i}"
        path.write_bytes(b"x")
        seg = Segment(0, path, -1, 1, 0)
        files.fd(seg)
        segs.append(seg)
    failures = [OSError(errno.EMFILE, "Too many open files")]

    def opener() -> int:
        if failures:
            raise failures.pop()
        return os.open(tmp_path / "0", os.O_RDONLY)

    extra = Segment(0, tmp_path / "extra", -1, 0, 0)
    assert files.opened(extra, opener) >= 0
    assert len(files) == 5  # a quarter of the six, and one more, were closed to make room
    assert [seg.fd for seg in segs[:2]] == [-1, -1]
    assert files.fd(segs[0]) >= 0  # opened again when used
    for seg in [*segs, extra]:
        files.close(seg)
    assert len(files) == 0


def test_a_descriptor_that_cannot_be_had_is_a_retriable_error(
    open_store: Callable[..., BrokerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    from qmq.store.datadir import OutOfFilesError

    store = open_store(open_files_max=FILES_MAX)
    real_open = os.open
    blocked = True

    def no_descriptor(path: object, flags: int, *args: int) -> int:
        if blocked and "consume" in str(path):
            raise OSError(errno.EMFILE, "Too many open files")
        return real_open(path, flags, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "open", no_descriptor)
    with pytest.raises(OutOfFilesError):
        append(store, batch("new-subject", ["a"]))
    assert store.failed is None
    blocked = False
    assert append(store, batch("new-subject", ["a"])).stored == 1
    flush(store)
    gp = store.group("new-subject", "g", "earliest")
    got = store.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert records(got) == [(0, "a")]
