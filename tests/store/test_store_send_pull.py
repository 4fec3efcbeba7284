"""Appending, flushing, pulling and acking through the broker store, without a server."""

from __future__ import annotations

from collections.abc import Callable

import msgpack

from conftest import append, batch, flush
from qmq.protocol.codes import Status
from qmq.protocol.message import decode_message
from qmq.protocol.record import RECORD_HEADER_BYTES, read_record_header
from qmq.store.broker_store import BrokerStore, PullResult
from qmq.store.progress import REDELIVERY_RUNS_MAX


def records(result: PullResult) -> list[tuple[int, str]]:
    """(sequence, message id) of every record in a pull result."""
    data = b"".join(result.chunks)
    out = []
    pos = 0
    while pos < len(data):
        h = read_record_header(data, pos)
        assert h is not None
        msg = decode_message(data, pos + RECORD_HEADER_BYTES, h.length)
        out.append((h.sequence, msg.message_id))
        pos += RECORD_HEADER_BYTES + h.length
    return out


def test_sync_policy_hides_messages_from_reads_until_flushed(open_store: Callable[..., BrokerStore]) -> None:
    # a pull takes them at once: its answer waits for the flush (test_store_pull_before_fsync.py)
    store = open_store()
    res = append(store, batch("order.paid", ["a", "b", "c"]))
    assert res.stored == 3
    assert not res.errors
    assert store.read_range("order.paid", 0, 10) == (0, 0, [])
    assert flush(store) == {"order.paid"}
    assert store.read_range("order.paid", 0, 10)[:2] == (0, 3)
    gp = store.group("order.paid", "billing", "earliest")
    got = store.pull(gp, gp.consumer("c1"), "s1", 10)
    assert got is not None
    assert records(got) == [(0, "a"), (1, "b"), (2, "c")]
    assert got.runs == [[0, 3]]


def test_periodic_policy_shows_messages_once_written(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store(flush="periodic")
    append(store, batch("s", ["a"]))
    gp = store.group("s", "g", "earliest")
    got = store.pull(gp, gp.consumer("c"), "x", 10)
    assert got is not None
    assert records(got) == [(0, "a")]


def test_duplicate_ids_are_dropped_within_a_batch_and_across_batches(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    assert append(store, batch("s", ["a", "a", "b"])).duplicates == 1
    res = append(store, batch("s", ["b", "c"]))
    assert (res.stored, res.duplicates) == (1, 1)
    assert store.subjects["s"].next_seq == 3


def test_bad_messages_are_refused_by_index_and_the_rest_stored(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    body = batch("ok", ["1"]) + batch("bad subject", ["2"]) + batch("ok", ["3"]) + batch("x%y", ["4"])
    res = append(store, body)
    assert res.stored == 2
    assert [(e[0], e[1]) for e in res.errors] == [(1, Status.INVALID_SUBJECT), (3, Status.INVALID_SUBJECT)]
    assert "bad subject" in res.errors[0][2]


def test_group_members_share_the_subject(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", [str(i) for i in range(10)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    a = store.pull(gp, gp.consumer("a"), "sa", 4)
    b = store.pull(gp, gp.consumer("b"), "sb", 100)
    assert a is not None
    assert b is not None
    ids_a = {i for _s, i in records(a)}
    ids_b = {i for _s, i in records(b)}
    assert len(ids_a) == 4
    assert len(ids_b) == 6
    assert not ids_a & ids_b


def test_new_group_starts_from_latest_unless_earliest(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", ["old"]))
    flush(store)
    late = store.group("s", "late", "latest")
    early = store.group("s", "early", "earliest")
    append(store, batch("s", ["new"]))
    flush(store)
    got_late = store.pull(late, late.consumer("c"), "x", 10)
    got_early = store.pull(early, early.consumer("c"), "x", 10)
    assert got_late is not None
    assert [i for _s, i in records(got_late)] == ["new"]
    assert got_early is not None
    assert [i for _s, i in records(got_early)] == ["old", "new"]


def test_ack_offset_advances_only_over_the_contiguous_prefix(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", [str(i) for i in range(5)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    store.pull(gp, cp, "x", 5)
    assert store.ack(gp, cp, [[1, 3]]) == 0
    assert store.ack(gp, cp, [[4, 5]]) == 0
    assert store.ack(gp, cp, [[0, 1]]) == 3
    assert store.ack(gp, cp, [[3, 4]]) == 5
    assert cp.unacked == 0


def test_new_session_gets_unacked_messages_again_but_not_acked_ones(open_store: Callable[..., BrokerStore]) -> None:
    store = open_store()
    append(store, batch("s", [str(i) for i in range(6)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    first = store.pull(gp, cp, "session-1", 6)
    assert first is not None
    assert first.messages == 6
    store.ack(gp, cp, [[0, 2], [3, 4]])
    assert store.pull(gp, cp, "session-1", 10) is None
    again = store.pull(gp, cp, "session-2", 10)
    assert again is not None
    assert [i for _s, i in records(again)] == ["2", "4", "5"]
    assert again.runs == [[2, 1], [4, 2]]


def test_same_id_on_another_subject_or_attempt_is_not_a_duplicate(open_store: Callable[..., BrokerStore]) -> None:
    from qmq.protocol.message import with_times

    store = open_store()
    first = batch("s", ["a"])
    retry = with_times(first, 1, subject=b"%RETRY%s%g")
    res = append(store, first + retry + with_times(first, 2, subject=b"%RETRY%s%g") + batch("other", ["a"]))
    assert (res.stored, res.duplicates) == (4, 0)
    assert append(store, retry).duplicates == 1


def test_a_redelivery_of_scattered_unacked_messages_is_cut_into_answers_of_bounded_runs(
    open_store: Callable[..., BrokerStore],
) -> None:
    # every other message acknowledged: each unacked one is a run of its own in the answer's
    # header, which must stay far inside the 64 KiB a frame header may hold
    n = 2 * (REDELIVERY_RUNS_MAX + 500)
    store = open_store()
    for start in range(0, n, 1000):
        append(store, batch("s", [str(i) for i in range(start, start + 1000)], body=b"x"))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    for _ in range(n // 1000):
        assert store.pull(gp, cp, "session-1", 1000) is not None
    store.ack(gp, cp, [[i, i + 1] for i in range(0, n, 2)])
    first = store.pull(gp, cp, "session-2", 10_000)
    assert first is not None
    assert len(first.runs) == REDELIVERY_RUNS_MAX
    assert len(msgpack.packb({"runs": first.runs})) < 64 * 1024 // 2
    rest = store.pull(gp, cp, "session-2", 10_000)  # the next pull goes on where the last stopped
    assert rest is not None
    got = [i for _s, i in records(first) + records(rest)]
    assert got == [str(i) for i in range(1, n, 2)]


def test_groups_pulling_the_same_records_in_one_request_read_them_once(open_store: Callable[..., BrokerStore]) -> None:
    # A fan-out's PULL_MANY pulls every group of a subject at once: the records one group's
    # pull read and checked are taken by the next group that pulls the same ones.
    store = open_store()
    append(store, batch("s", [f"m{i}" for i in range(5)]))
    flush(store)
    gps = [store.group("s", f"g{i}", "earliest") for i in range(3)]
    with store.shared_reads():
        got = [store.pull(gp, gp.consumer("c"), "x", 10) for gp in gps[:2]]
        behind = store.pull(gps[2], gps[2].consumer("c"), "x", 2)  # other records: its own read
    assert all(r is not None for r in got)
    assert behind is not None
    assert got[1].chunks[0] is got[0].chunks[0]
    assert behind.chunks[0] is not got[0].chunks[0]
    assert [records(r) for r in got] == [[(i, f"m{i}") for i in range(5)]] * 2
    assert records(behind) == [(0, "m0"), (1, "m1")]
    assert [gp.pull_offset for gp in gps] == [5, 5, 2]
    append(store, batch("s", ["n"]))
    flush(store)
    apart = [store.pull(gp, gp.consumer("c"), "x", 10) for gp in gps[:2]]  # outside: each reads
    assert apart[0] is not None
    assert apart[1] is not None
    assert apart[1].chunks[0] is not apart[0].chunks[0]
    assert store._pulls.reads is None


def test_records_of_subjects_sent_to_together_are_read_one_by_one_across_segments(
    open_store: Callable[..., BrokerStore],
) -> None:
    """Three subjects' records alternate in the log (each pull reads every record apart from the
    next), in segments that roll every few records: every pull hands out its own, in order."""
    store = open_store(segment_bytes=4096, flush="periodic")
    subjects = ["a", "b", "c"]
    for j in range(40):
        append(store, b"".join(batch(s, [f"{s}{j}"], body=bytes([j]) * 300) for s in subjects))
    assert len(store.mlog.segments.segments) > 5
    for s in subjects:
        gp = store.group(s, "g", "earliest")
        cp = gp.consumer("c")
        got: list[tuple[int, str]] = []
        while (result := store.pull(gp, cp, "session-1", 7)) is not None:
            assert len(result.chunks) == result.messages  # one read a record: none lie side by side
            got += records(result)
        assert got == [(j, f"{s}{j}") for j in range(40)]
