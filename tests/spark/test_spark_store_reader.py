"""store/reader.py: a broker's files read while it runs, never changed, torn tails ignored."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path

import pytest
from sparkhelpers import send_messages

from qmq.protocol.message import decode_message
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.spark.records import records_to_batch
from qmq.store.file_header import HEAD_BYTES
from qmq.store.reader import DataDirError, StoreReader

pytestmark = pytest.mark.integration


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    out = {}
    for root, _dirs, files in os.walk(directory):
        for name in files:
            if name in ("checkpoint", "checkpoint.tmp"):
                continue  # the running broker replaces it periodically
            st = os.stat(os.path.join(root, name))
            out[os.path.join(root, name)] = (st.st_size, st.st_mtime_ns)
    return out


def _copy_unless_gone(src: str, dst: str) -> None:
    """Copy a file of the running broker; one it deleted meanwhile (an old checkpoint) is skipped."""
    with contextlib.suppress(FileNotFoundError):
        shutil.copy2(src, dst)


def test_reads_a_running_brokers_subject_by_sequence_without_touching_its_files(
    meta_server: str, subject: str, data_dir: str
) -> None:
    ids = send_messages(meta_server, subject, 50)
    reader = StoreReader(data_dir)  # the standalone's directory: the broker's files are under broker/
    assert subject in reader.subjects()
    assert reader.bounds(subject) == (0, 50)
    lock_fd = os.open(reader.dir / "LOCK", os.O_RDONLY)
    os.close(lock_fd)
    before = _snapshot(reader.dir / "consume" / reader.subjects()[subject].name)
    runs = list(reader.iter_records(subject))
    got = [row["message_id"] for run in runs for row in records_to_batch(run.data, subject, "g").to_pylist()]
    assert got == ids
    middle = reader.read(subject, 20, 23)
    assert (middle.first, middle.records) == (20, 3)
    header = read_record_header(middle.data, 0)
    assert header is not None
    assert decode_message(middle.data, RECORD_HEADER_BYTES, header.length).message_id == ids[20]
    assert reader.read(subject, 50, 60).records == 0
    assert _snapshot(reader.dir / "consume" / reader.subjects()[subject].name) == before


def test_a_torn_tail_is_not_read_and_a_copy_is_left_as_it_was(
    meta_server: str, subject: str, data_dir: str, tmp_path: Path
) -> None:
    send_messages(meta_server, subject, 10)
    src = StoreReader(data_dir)
    copy = tmp_path / "copy"
    shutil.copytree(src.dir, copy, ignore=shutil.ignore_patterns("LOCK"), copy_function=_copy_unless_gone)
    # a torn tail can only lie past the last checkpoint (what it covers was fsynced), and the reader
    # checks CRCs from there on: without a checkpoint in the copy, every record is past it
    for checkpoint in copy.glob("checkpoint*"):
        checkpoint.unlink()
    clog_dir = copy / "consume" / src.subjects()[subject].name
    last_clog = sorted(clog_dir.glob("*.cl"))[-1]
    last_log = sorted((copy / "log").glob("*.log"))[-1]
    # damage the last record of the subject: flip a byte of its message (its CRC no longer matches)
    reader = StoreReader(copy)
    end = reader.bounds(subject)[1]
    raw = last_clog.read_bytes()
    offset = HEAD_BYTES + int.from_bytes(raw[-32:-24], "little") - int(last_log.name[:20])
    data = bytearray(last_log.read_bytes())
    data[offset + RECORD_HEADER_BYTES + 10] ^= 0xFF
    last_log.write_bytes(bytes(data))
    sizes = _snapshot(copy)
    assert reader.bounds(subject) == (0, end - 1)
    assert sum(run.records for run in reader.iter_records(subject, 0, end)) == end - 1
    assert _snapshot(copy) == sizes


def test_a_directory_that_is_no_brokers_is_refused_by_name(tmp_path: Path) -> None:
    with pytest.raises(DataDirError, match="not a broker's data directory"):
        StoreReader(tmp_path)


def test_consumer_progress_and_actions_read_from_the_files(meta_server: str, subject: str, data_dir: str) -> None:
    import qmq

    send_messages(meta_server, subject, 5)
    with qmq.Consumer(app_code="t", meta_server=meta_server, consumer_id="reader-c1") as consumer:
        pull = consumer.pull_consumer(subject, "readers", start_from="earliest")
        got = 0
        for _ in range(20):
            batch = pull.pull(max_messages=5, timeout_ms=1_000)
            for m in batch:
                m.ack()
            got += len(batch)
            if got >= 5:
                break
        pull.pull(max_messages=1, timeout_ms=0)  # carries the acks
    progress, _at = StoreReader(data_dir).progress()
    gp = progress.get(subject, "readers")
    assert gp is not None
    assert gp.pull_offset == 5
    assert gp.consumers["reader-c1"].ack_offset == 5
