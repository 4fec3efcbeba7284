"""Recovery of the broker store after a stop, a crash, or a torn tail."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from test_store_send_pull import records

from conftest import append, batch, checkpoint, flush
from qmq.protocol.message import encode_message
from qmq.store.broker_store import BrokerStore
from qmq.store.datadir import StoreError
from qmq.store.file_header import HEAD_BYTES
from qmq.store.retention import run_retention


def test_restart_keeps_messages_and_consumer_progress(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", [str(i) for i in range(10)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    store.pull(gp, cp, "x", 4)
    store.ack(gp, cp, [[0, 2]])
    checkpoint(store)
    store.pull(gp, cp, "x", 2)  # after the checkpoint: replayed from the action log
    store.ack(gp, cp, [[4, 5]])
    store.close()

    again = open_store()
    gp2 = again.progress.get("s", "g")
    assert gp2 is not None
    assert gp2.pull_offset == 6
    cp2 = gp2.consumers["c"]
    assert (cp2.pull_log_end, cp2.ack_offset, cp2.acked) == (6, 2, [[4, 5]])
    got = again.pull(gp2, cp2, "new-session", 100)
    assert got is not None
    # unacked 2, 3, 5 again, then the rest of the subject
    assert [i for _s, i in records(got)] == ["2", "3", "5", "6", "7", "8", "9"]


def test_torn_tail_is_cut_and_earlier_messages_survive(open_store: Callable[..., BrokerStore], tmp_path: Path) -> None:
    store = open_store()
    append(store, batch("s", ["a", "b"]))
    append(store, batch("s", ["c"]))
    flush(store)
    store.close()
    seg = sorted((tmp_path / "broker" / "log").glob("*.log"))[-1]
    size = seg.stat().st_size
    with open(seg, "r+b") as fh:
        fh.truncate(size - 10)  # the last record is torn

    again = open_store()
    st = again.subjects["s"]
    assert st.next_seq == 2
    gp = again.group("s", "g", "earliest")
    got = again.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert [i for _s, i in records(got)] == ["a", "b"]
    # the next message takes the freed sequence
    append(again, batch("s", ["d"]))
    flush(again)
    more = again.pull(gp, gp.consumer("c"), "x", 10)
    assert more is not None
    assert records(more) == [(2, "d")]


def test_corrupt_byte_in_the_tail_is_detected_by_crc(open_store: Callable[..., BrokerStore], tmp_path: Path) -> None:
    store = open_store()
    append(store, batch("s", ["a"]))
    append(store, batch("s", ["b"]))
    store.close()
    seg = sorted((tmp_path / "broker" / "log").glob("*.log"))[-1]
    data = bytearray(seg.read_bytes())
    data[-5] ^= 0xFF
    seg.write_bytes(bytes(data))
    again = open_store()
    assert again.subjects["s"].next_seq == 1


def test_lost_consume_log_entries_are_rebuilt_from_the_message_log(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    append(store, batch("s", ["a"]))
    checkpoint(store)
    append(store, batch("s", ["b", "c"]))
    store.close()
    clog = next((tmp_path / "broker" / "consume").glob("s/*.cl"))
    with open(clog, "r+b") as fh:
        # as if the process died between the message-log and consume-log writes, in the middle of an entry
        fh.truncate(HEAD_BYTES + 32 + 10)
    again = open_store()
    assert again.subjects["s"].next_seq == 3
    gp = again.group("s", "g", "earliest")
    got = again.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert [i for _s, i in records(got)] == ["a", "b", "c"]


def test_a_consume_log_cut_below_the_checkpoint_is_rebuilt_from_the_message_log(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    # Found by the fault campaign (chaos/, corruption): entries lost before the checkpoint were
    # only logged ("had N messages at the checkpoint but only M are on disk"), never rebuilt.
    store = open_store()
    append(store, batch("s", [str(i) for i in range(6)]))
    flush(store)
    checkpoint(store)
    append(store, batch("s", ["6"]))
    store.close()
    clog = next((tmp_path / "broker" / "consume").glob("s/*.cl"))
    with open(clog, "r+b") as fh:
        fh.truncate(HEAD_BYTES + 32 * 2)  # two entries left of the six the checkpoint counts
    again = open_store()
    assert again.subjects["s"].next_seq == 7
    gp = again.group("s", "g", "earliest")
    got = again.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert [i for _s, i in records(got)] == [str(i) for i in range(7)]


def test_duplicate_window_survives_a_restart(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["a", "b"]))
    checkpoint(store)
    append(store, batch("s", ["c"]))
    store.close()
    again = open_store()
    res = append(again, batch("s", ["a", "c", "d"]))
    assert (res.stored, res.duplicates) == (1, 2)


def test_second_store_on_the_same_directory_is_refused(open_store: Callable[..., BrokerStore]) -> None:
    open_store()
    with pytest.raises(StoreError, match="in use by another broker"):
        open_store()


def test_retention_deletes_old_segments_and_pulls_skip_them(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store(segment_bytes=64 * 1024, retention_hours=1.0)
    for n in range(6):
        append(store, batch("s", [f"{n}-{i}" for i in range(100)], body=b"y" * 200))
    flush(store)
    gp = store.group("s", "g", "earliest")
    segs = store.mlog.segments.segments
    assert len(segs) > 2
    old = store.clock.now_ms() / 1000 - 7200
    for seg in segs[:2]:
        os.utime(seg.path, (old, old))
    assert run_retention(store) == 2
    got = store.pull(gp, gp.consumer("c"), "x", 10_000)
    assert got is not None
    seqs = [s for s, _i in records(got)]
    assert seqs[0] > 0
    assert seqs[-1] == 599
    assert seqs == list(range(seqs[0], 600))


def test_dead_letters_are_indexed_once_and_removals_replayed(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("%DEAD_RETRY%s%g", ["d1", "d2"]))
    [first, second] = store.dead.letters("%DEAD_RETRY%s%g")
    store.remove_dead("%DEAD_RETRY%s%g", [first.number])
    store.close()  # no checkpoint: recovery replays the whole message log and action log
    again = open_store()
    letters = again.dead.letters("%DEAD_RETRY%s%g")
    assert [letter.number for letter in letters] == [second.number]
    assert again.dead.live("%DEAD_RETRY%s%g") == 1


def test_a_restart_sets_up_idle_consume_logs_on_first_use_and_still_repairs_each_at_once(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    append(store, b"".join(batch(f"s{i}", [f"m{i}"]) for i in range(20)))
    flush(store)
    checkpoint(store)
    append(store, batch("s0", ["after"]))  # its record is torn below: its entry points past the log
    flush(store)
    store.close()
    consume = tmp_path / "broker" / "consume"
    (torn_entry,) = (consume / "s3").glob("*.cl")
    with open(torn_entry, "ab") as fh:
        fh.write(b"\x01" * 5)  # a torn last entry
    (seg,) = (tmp_path / "broker" / "log").glob("*.log")
    with open(seg, "r+b") as fh:
        fh.truncate(seg.stat().st_size - 10)

    again = open_store()
    # what needed a repair was set up and repaired now; the 18 idle logs hold no file open
    assert len(again.consume_files) == 2
    assert torn_entry.stat().st_size == HEAD_BYTES + 32
    assert again.subjects["s0"].next_seq == 1
    assert (consume / "s0" / "00000000000000000000.cl").stat().st_size == HEAD_BYTES + 32
    assert {name: st.next_seq for name, st in again.subjects.items()} == {f"s{i}": 1 for i in range(20)}
    gp = again.group("s7", "g", "earliest")
    got = again.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert records(got) == [(0, "m7")]
    assert len(again.consume_files) == 3
    append(again, batch("s9", ["next"]))
    flush(again)
    gp = again.group("s9", "g", "earliest")
    got = again.pull(gp, gp.consumer("c"), "y", 10)
    assert got is not None
    assert records(got) == [(0, "m9"), (1, "next")]


def test_records_before_the_checkpoint_are_read_for_their_ids_alone_and_still_repeat(
    open_store: Callable[..., BrokerStore],
) -> None:
    # A busy broker's restart read its last ten minutes of records one by one, every CRC and
    # message decoded, only to see their ids again (4.8 µs each): they are now read for their
    # keys alone, and a repeat of any of them is still known, at the same attempt only.
    store = open_store()
    ids = [f"id-{i}" for i in range(300)]
    for k in range(0, 300, 50):
        append(store, batch(f"s{k % 3}", ids[k : k + 50]))
    checkpoint(store)
    append(store, batch("s0", ["after"]))
    store.close()
    again = BrokerStore(store.config, clock=store.clock)
    report = again.open()
    assert (report.window_records, report.records_scanned) == (300, 1)
    res = append(again, batch("s0", ["id-0", "id-150", "after", "new"]) + batch("s1", ["id-0"]))
    assert (res.stored, res.duplicates) == (2, 3)  # id-0 on s1 is another subject's: a new message
    retried = encode_message(b"s0", b"id-1", b"", 0, b"", b"x", 1, times=2)
    assert append(again, retried).stored == 1  # a retry's next attempt is a new message
    again.close()
