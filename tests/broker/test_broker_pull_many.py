"""PULL_MANY against a real broker (flush = "sync", the default): one answer for many (subject,
group) pairs, each result naming its part of the body; a refused entry fails alone; its
answer goes out only after the fsync covering what it handed out (the I/O trace)."""

from __future__ import annotations

import time
from pathlib import Path

from rawclient import RawClient, message, split_records

from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import decode_message
from qmq.store.trace_check import check_file
from qmq.testing import running_role


def _ids(body: bytes) -> list[str]:
    return [decode_message(m).message_id for _seq, m in split_records(body)]


def test_pull_many_answers_each_entry_with_its_part_and_a_bad_entry_alone(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    args = ["broker", "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0"]
    with running_role(args, env={"QMQ_IO_TRACE": str(trace)}) as proc:
        client = RawClient(proc.ready["address"])
        try:
            for s in ("a", "b", "c"):
                assert client.send(*(message(s, f"{s}{i}") for i in range(3))).status == Status.OK
            entries = [
                {"subject": "a", "group": "g", "max": 2, "start": "earliest"},
                {"subject": "b", "group": "g", "max": 10, "start": "earliest", "tags": "not a list"},
                "not a map",
                {"subject": "c", "group": "g", "max": 10, "start": "earliest"},
                {"subject": "empty", "group": "g", "max": 10, "start": "earliest"},
            ]
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "pulls": entries}
            answer = client.call(RequestCode.PULL_MANY, header)
            assert answer.status == Status.OK, answer.header
            results = answer.header["results"]
            assert [("error" in r) for r in results] == [False, True, True, False, False]
            assert "tags" in results[1]["error"]
            body = bytes(answer.body)
            a_bytes = results[0]["bytes"]
            assert _ids(body[:a_bytes]) == ["a0", "a1"]
            assert _ids(body[a_bytes : a_bytes + results[3]["bytes"]]) == ["c0", "c1", "c2"]
            assert results[0]["runs"] == [[0, 2]]
            assert results[4] == {"runs": [], "bytes": 0}
            # the acks ride on the entries; the answer caps the total
            entries = [
                {"subject": "a", "group": "g", "max": 10, "ack": [[0, 2]]},
                {"subject": "c", "group": "g", "max": 10, "ack": [[0, 3]]},
                {"subject": "b", "group": "g", "max": 10, "start": "earliest"},
            ]
            header = {"consumer_id": "c1", "session": "s1", "max": 2, "pulls": entries}
            answer = client.call(RequestCode.PULL_MANY, header)
            results = answer.header["results"]
            assert [r["runs"] for r in results] == [[[2, 1]], [], [[0, 1]]]
            assert _ids(bytes(answer.body)) == ["a2", "b0"]
            # a new session gets again what it was handed and never acked: a2 and b0, not c's
            entries = [{"subject": s, "group": "g", "max": 10} for s in ("a", "b", "c")]
            header = {"consumer_id": "c1", "session": "s2", "max": 100, "pulls": entries}
            again = client.call(RequestCode.PULL_MANY, header)
            assert [r["runs"] for r in again.header["results"]] == [[[2, 1]], [[0, 3]], []]
            assert _ids(bytes(again.body)) == ["a2", "b0", "b1", "b2"]
        finally:
            client.close()
        assert proc.stop() == 0
    report = check_file(trace)
    assert report.violations == [], report.violations
    assert report.pulls >= 4  # each answer that handed out messages: its records and its messages


def test_pull_many_long_polls_on_all_its_subjects_and_answers_after_the_flush(tmp_path: Path) -> None:
    trace = tmp_path / "trace"
    args = ["broker", "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0"]
    with running_role(args, env={"QMQ_IO_TRACE": str(trace)}) as proc:
        waiter = RawClient(proc.ready["address"])
        sender = RawClient(proc.ready["address"])
        try:
            entries = [{"subject": s, "group": "g", "max": 10, "start": "earliest"} for s in ("x", "y", "z")]
            # nothing anywhere: a short wait is answered empty once it passes
            t0 = time.monotonic()
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "pulls": entries, "timeout_ms": 300}
            empty = waiter.call(RequestCode.PULL_MANY, header)
            assert empty.status == Status.OK, empty.header
            assert time.monotonic() - t0 >= 0.25
            assert [r["runs"] for r in empty.header["results"]] == [[], [], []]
            # a long wait is answered by the first send to any of its subjects
            header = {**header, "timeout_ms": 20_000}
            t0 = time.monotonic()
            waiter.send_frame(RequestCode.PULL_MANY, header)
            assert sender.send(message("y", "y0"), message("y", "y1")).status == Status.OK
            answer = waiter.read_frame()
            assert time.monotonic() - t0 < 10
            assert answer.status == Status.OK, answer.header
            assert [r["runs"] for r in answer.header["results"]] == [[], [[0, 2]], []]
            assert _ids(bytes(answer.body)) == ["y0", "y1"]
            # its acks are applied at once and the answer still waits for them to be durable
            entries = [{**entries[0]}, {**entries[1], "ack": [[0, 2]]}, {**entries[2]}]
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "pulls": entries, "timeout_ms": 20_000}
            waiter.send_frame(RequestCode.PULL_MANY, header)
            assert sender.send(message("z", "z0")).status == Status.OK
            answer = waiter.read_frame()
            assert [r["runs"] for r in answer.header["results"]] == [[], [], [[0, 1]]]
            assert _ids(bytes(answer.body)) == ["z0"]
            # a new session gets nothing of y again: its acks took
            entries = [{"subject": s, "group": "g", "max": 10} for s in ("x", "y", "z")]
            header = {"consumer_id": "c1", "session": "s2", "max": 100, "pulls": entries}
            again = waiter.call(RequestCode.PULL_MANY, header)
            assert [r["runs"] for r in again.header["results"]] == [[], [], [[0, 1]]]
        finally:
            waiter.close()
            sender.close()
        assert proc.stop() == 0
    report = check_file(trace)
    assert report.violations == [], report.violations
    assert report.pulls >= 2


def test_groups_pulling_the_same_records_share_them_when_the_request_says_share(tmp_path: Path) -> None:
    # A fan-out: the groups of one subject pulled together get the same records. Before, the
    # answer carried them once a group (70 times for 70 groups) and the client read and checked
    # each copy; with "share" a group whose records are an earlier group's refers to them.
    args = ["broker", "--data-dir", str(tmp_path / "data"), "--port", "0", "--http-port", "0"]
    with running_role(args) as proc:
        client = RawClient(proc.ready["address"])
        try:
            assert client.send(*(message("f", f"f{i}") for i in range(4))).status == Status.OK
            groups = [{"subject": "f", "group": f"g{i}", "max": 10, "start": "earliest"} for i in range(3)]
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "share": True, "pulls": groups}
            answer = client.call(RequestCode.PULL_MANY, header)
            results = answer.header["results"]
            size = results[0]["bytes"]
            assert results[1:] == [{"runs": [[0, 4]], "bytes": 0, "same": 0}] * 2
            assert _ids(bytes(answer.body)) == ["f0", "f1", "f2", "f3"]  # once, not three times
            assert len(answer.body) == size
            # g0 behind the others: its records differ, so it carries its own; g2 shares g1's
            assert client.send(message("f", "f4")).status == Status.OK
            acks = [[0, 4]]
            pulls = [
                {"subject": "f", "group": "g0", "max": 10, "ack": acks},
                {"subject": "f", "group": "g1", "max": 10, "ack": acks},
                {"subject": "f", "group": "g2", "max": 10, "ack": acks},
            ]
            pulls[0]["max"] = 0  # g0 only acks this time
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "share": True, "pulls": pulls}
            answer = client.call(RequestCode.PULL_MANY, header)
            results = answer.header["results"]
            assert results[0] == {"runs": [], "bytes": 0}
            assert results[2] == {"runs": [[4, 1]], "bytes": 0, "same": 1}
            assert _ids(bytes(answer.body)) == ["f4"]
            # without "share" every group's records come whole, as before
            pulls = [{"subject": "f", "group": f"h{i}", "max": 10, "start": "earliest"} for i in range(2)]
            header = {"consumer_id": "c1", "session": "s1", "max": 100, "pulls": pulls}
            answer = client.call(RequestCode.PULL_MANY, header)
            assert [r.get("same") for r in answer.header["results"]] == [None, None]
            assert _ids(bytes(answer.body)) == [f"f{i}" for i in range(5)] * 2
        finally:
            client.close()
        assert proc.stop() == 0
