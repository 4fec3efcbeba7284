"""The broker over its wire protocol: commands, errors, hostile input, long polls."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgpack
import pytest
from rawclient import RawClient, message, split_records

from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.frame import PREFIX
from qmq.protocol.message import decode_message, encode_message
from qmq.testing import ReadyProcess, running_role

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    data = tmp_path_factory.mktemp("broker")
    with running_role(["broker", "--data-dir", str(data), "--port", "0", "--http-port", "0"]) as proc:
        yield proc


@pytest.fixture
def client(broker: ReadyProcess) -> Iterator[RawClient]:
    c = RawClient(broker.ready["address"])
    yield c
    c.close()


def test_ping(client: RawClient) -> None:
    resp = client.call(RequestCode.PING)
    assert resp.status == Status.OK
    assert resp.header["role"] == "broker"


def test_a_send_refuses_by_index_what_consumers_could_not_read(client: RawClient, subject: str) -> None:
    good = message(subject, "good-1", b"ok", {"k": "v"})
    bad = [
        encode_message(subject.encode(), b"id-\xff", b"", 0, b"", b"x", 1),
        encode_message(subject.encode(), b"bad-tag", b"\x02\xc3(", 1, b"", b"x", 1),
        encode_message(subject.encode(), b"bad-props", b"", 0, b"\xc1", b"x", 1),
        encode_message(subject.encode(), b"bad-times", b"", 0, b"", b"x", 1, 0, 65535),
    ]
    resp = client.send(good, *bad, message(subject, "good-2"))
    assert resp.status == Status.OK
    errors = {index: (status, text) for index, status, text in answer_of(resp)["errors"]}
    assert sorted(errors) == [1, 2, 3, 4]
    assert all(status == Status.INVALID_MESSAGE for status, _ in errors.values())
    assert "message id is not valid UTF-8" in errors[1][1]
    assert "tags are not valid UTF-8" in errors[2][1]
    assert "properties are not one msgpack map" in errors[3][1]
    assert "times) 65535 is over attempts_max" in errors[4][1]
    got = client.pull(subject, "g")
    assert [decode_message(m).message_id for _seq, m in split_records(got.body)] == ["good-1", "good-2"]


def test_send_then_pull_returns_the_stored_bytes(client: RawClient, subject: str) -> None:
    m1 = message(subject, "id-1", b"hello", {"orderId": "42"})
    m2 = message(subject, "id-2", b"world")
    resp = client.send(m1, m2)
    assert resp.status == Status.OK
    assert answer_of(resp) == {"errors": [], "duplicates": 0}
    got = client.pull(subject, "g")
    assert got.header["runs"] == [[0, 2]]
    records = split_records(bytes(got.body))
    assert [r[1] for r in records] == [m1, m2]
    assert decode_message(records[0][1]).body == b"hello"


def test_refused_messages_are_named_by_index(client: RawClient, subject: str) -> None:
    resp = client.send(message(subject, "a"), message("has space", "b"), message(subject, "c", deliver_at_ms=2**50))
    assert resp.status == Status.OK
    errors = {e[0]: (e[1], e[2]) for e in answer_of(resp)["errors"]}
    assert set(errors) == {1, 2}
    assert errors[1][0] == Status.INVALID_SUBJECT
    assert "has space" in errors[1][1]
    assert errors[2][0] == Status.INVALID_MESSAGE
    assert "delay server" in errors[2][1]


def test_a_broker_holding_held_messages_max_refuses_more_as_busy(tmp_path: Path, subject: str) -> None:
    """Messages due a moment ahead are held until due (qmq.store.held); the held set is bounded."""
    config = tmp_path / "held.toml"
    config.write_text("[broker]\nheld_messages_max = 2\n")
    data = tmp_path / "data"
    argv = ["broker", "--data-dir", str(data), "--port", "0", "--http-port", "0", "--config", str(config)]
    with running_role(argv) as proc:
        c = RawClient(proc.ready["address"])
        try:
            due = int(time.time() * 1000) + 800
            held = c.send(message(subject, "h1", deliver_at_ms=due), message(subject, "h2", deliver_at_ms=due))
            assert answer_of(held) == {"errors": [], "duplicates": 0}
            refused = c.send(message(subject, "h3", deliver_at_ms=due))
            assert refused.status == Status.BUSY
            assert "holds 2 messages until they are due, its held_messages_max" in refused.header["error"]
            realtime = c.send(message(subject, "now"))  # nothing to hold: taken
            assert answer_of(realtime) == {"errors": [], "duplicates": 0}
            got = c.pull(subject, "g", timeout_ms=3000)
            first = [decode_message(r[1]).message_id for r in split_records(bytes(got.body))]
            assert first == ["now"]
            later = c.pull(subject, "g", timeout_ms=3000)  # a long poll woken by the release
            assert int(time.time() * 1000) >= due
            assert [decode_message(r[1]).message_id for r in split_records(bytes(later.body))] == ["h1", "h2"]
        finally:
            c.close()


def test_a_repeated_id_is_stored_once(client: RawClient, subject: str) -> None:
    client.send(message(subject, "dup"))
    resp = client.send(message(subject, "dup"))
    assert answer_of(resp)["duplicates"] == 1
    assert len(split_records(bytes(client.pull(subject, "g").body))) == 1


def test_long_poll_waits_for_a_send(broker: ReadyProcess, client: RawClient, subject: str) -> None:
    client.pull(subject, "g", start="latest")  # creates the group at the end of the subject

    def later() -> None:
        other = RawClient(broker.ready["address"])
        try:
            other.send(message(subject, "late"))
        finally:
            other.close()

    t0 = time.monotonic()
    timer = threading.Timer(0.2, later)
    timer.start()
    got = client.pull(subject, "g", timeout_ms=10_000)
    timer.join()
    assert got.header["runs"] == [[0, 1]]
    assert time.monotonic() - t0 < 5


def test_long_poll_times_out_empty(client: RawClient, subject: str) -> None:
    got = client.pull(subject, "g", timeout_ms=100)
    assert got.status == Status.OK
    assert got.header["runs"] == []
    assert not got.body


def test_ack_advances_and_lag_reports(client: RawClient, subject: str) -> None:
    client.send(*[message(subject, f"m{i}") for i in range(5)])
    client.pull(subject, "g", max_n=5)
    resp = client.call(
        RequestCode.ACK, {"subject": subject, "group": "g", "consumer_id": "c1", "ranges": [[0, 2], [3, 4]]}
    )
    assert resp.header["ack_offset"] == 2
    lag = answer_of(client.call(RequestCode.LAG, {"subject": subject, "group": "g"}))
    assert (lag["messages"], lag["backlog"], lag["unacked"]) == (5, 0, 2)
    subjects = answer_of(client.call(RequestCode.SUBJECTS))["subjects"]
    assert {"subject": subject, "messages": 5, "first": 0, "groups": ["g"]} in subjects


@pytest.mark.parametrize(
    ("header", "needle"),
    [
        ({"group": "g", "consumer_id": "c", "session": "s", "max": 1}, "subject"),
        ({"subject": "a b", "group": "g", "consumer_id": "c", "session": "s", "max": 1}, "'a b'"),
        ({"subject": "s", "group": "g", "consumer_id": "c", "session": "s", "max": 0}, "'max'"),
        ({"subject": "s", "group": "g", "consumer_id": "c", "session": "s", "max": 1, "start": "middle"}, "'start'"),
        ({"subject": "s", "group": "g", "consumer_id": "c", "session": "s", "max": 1, "ack": [[3, 1]]}, "'ack'"),
    ],
)
def test_bad_pull_headers_are_refused_naming_the_field(
    client: RawClient, header: dict[str, object], needle: str
) -> None:
    resp = client.call(RequestCode.PULL, header)
    assert resp.status == Status.BAD_REQUEST
    assert needle in resp.header["error"]


def test_unknown_command_keeps_the_connection(client: RawClient) -> None:
    resp = client.call(999)
    assert resp.status == Status.UNKNOWN_COMMAND
    assert client.call(RequestCode.PING).status == Status.OK


def test_malformed_batch_is_refused_and_the_connection_lives(client: RawClient) -> None:
    resp = client.call(RequestCode.SEND_MESSAGES, {}, b"\x01\x00garbage")
    assert resp.status == Status.BAD_REQUEST
    assert "malformed" in resp.header["error"]
    assert client.call(RequestCode.PING).status == Status.OK


def test_hostile_frame_closes_only_that_connection(broker: ReadyProcess, client: RawClient) -> None:
    bad = socket.create_connection(tuple(broker.ready["address"].rsplit(":", 1)))  # type: ignore[arg-type]
    try:
        header = msgpack.packb({})
        bad.sendall(PREFIX.pack(16 + len(header), 0xDEAD, 1, 0, 1, 0, 1, len(header)) + header)
        data = b""
        bad.settimeout(10)
        while chunk := bad.recv(65536):
            data += chunk
        assert b"bad magic" in data  # an error frame, then the broker closed the connection
    finally:
        bad.close()
    assert client.call(RequestCode.PING).status == Status.OK


def test_oversized_frame_is_refused_before_its_body(broker: ReadyProcess, client: RawClient) -> None:
    bad = socket.create_connection(tuple(broker.ready["address"].rsplit(":", 1)))  # type: ignore[arg-type]
    try:
        bad.sendall((1 << 31).to_bytes(4, "little"))
        bad.settimeout(10)
        data = b""
        while chunk := bad.recv(65536):
            data += chunk
        assert b"frame_bytes_max" in data
    finally:
        bad.close()
    assert client.call(RequestCode.PING).status == Status.OK


def test_metrics_and_health_are_served(broker: ReadyProcess, client: RawClient, subject: str) -> None:
    import urllib.request

    client.send(message(subject, "x", b"12345"))
    pulled = client.pull(subject, "metrics-g")
    client.pull(subject, "metrics-g", ack=[[0, 1]])  # acks it; finds nothing more
    text = urllib.request.urlopen(broker.ready["http"] + "/metrics", timeout=10).read().decode()
    assert f'qmq_messages_in_total{{subject="{subject}"}} 1.0' in text
    labels = f'{{group="metrics-g",subject="{subject}"}}'
    assert f"qmq_messages_out_total{labels} 1.0" in text
    assert f"qmq_bytes_out_total{labels} {float(len(pulled.body))}" in text
    assert f"qmq_acked_messages_total{labels} 1.0" in text
    assert 'qmq_pulls_total{outcome="messages"}' in text
    assert 'qmq_pulls_total{outcome="empty"}' in text
    assert "qmq_store_flush_seconds_bucket" in text
    assert "qmq_connections" in text
    health = urllib.request.urlopen(broker.ready["http"] + "/health", timeout=10).read()
    assert b'"ok": true' in health


def test_sigterm_exits_zero(tmp_path: Path) -> None:
    with running_role(["broker", "--data-dir", str(tmp_path / "b")]) as proc:
        c = RawClient(proc.ready["address"])
        c.send(message("s", "one"))
        c.close()
        assert proc.stop() == 0
    assert (tmp_path / "b" / "checkpoint").exists()


def test_a_second_broker_on_the_same_data_dir_fails_clearly(tmp_path: Path) -> None:
    import subprocess
    import sys

    with running_role(["broker", "--data-dir", str(tmp_path / "b")]):
        out = subprocess.run(
            [sys.executable, "-m", "qmq", "broker", "--data-dir", str(tmp_path / "b")],
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert out.returncode == 3
    assert "in use by another broker" in out.stderr
    assert "Traceback" not in out.stderr


def test_full_disk_refuses_sends_with_a_retriable_status(tmp_path: Path) -> None:
    # "full" = less free space than disk_free_bytes_min; a petabyte makes any disk full
    with running_role(["broker", "--data-dir", str(tmp_path / "b"), "--disk-free-bytes-min", str(1 << 50)]) as proc:
        c = RawClient(proc.ready["address"])
        resp = c.send(message("s", "a"))
        assert resp.status == Status.DISK_FULL
        assert "disk_free_bytes_min" in resp.header["error"]
        assert c.call(RequestCode.PING).status == Status.OK
        c.close()


def test_read_by_sequence_outside_any_group(client: RawClient, subject: str) -> None:
    client.send(*[message(subject, f"r{i}") for i in range(5)])
    resp = client.call(RequestCode.READ, {"subject": subject, "from": 2, "max": 2})
    assert resp.status == Status.OK
    assert (resp.header["first"], resp.header["count"], resp.header["start"], resp.header["end"]) == (2, 2, 0, 5)
    assert [seq for seq, _m in split_records(bytes(resp.body))] == [2, 3]
    empty = client.call(RequestCode.READ, {"subject": subject, "from": 5, "max": 10})
    assert empty.header["count"] == 0
    assert not empty.body
    unknown = client.call(RequestCode.READ, {"subject": "never.sent", "from": 0, "max": 10})
    assert unknown.header == {"first": 0, "count": 0, "start": 0, "end": 0}


def test_message_size_limit_is_configurable_and_refused_by_index(tmp_path: Path) -> None:
    with running_role(["broker", "--data-dir", str(tmp_path / "b"), "--message-bytes-max", "2048"]) as proc:
        c = RawClient(proc.ready["address"])
        resp = c.send(message("s", "small", b"x" * 100), message("s", "big", b"x" * 4000))
        assert resp.status == Status.OK
        [(index, status, text)] = answer_of(resp)["errors"]
        assert (index, status) == (1, Status.MESSAGE_TOO_LARGE)
        assert "message_bytes_max 2048" in text
        c.close()
