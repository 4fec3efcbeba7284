"""Consumption features on the broker: tags, broadcast, silent consumers, dead letters, resets."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
from rawclient import RawClient, message, split_records

from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import decode_message, encode_message, encode_properties, encode_tags
from qmq.testing import ReadyProcess, running_role

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    data = tmp_path_factory.mktemp("broker")
    with running_role(["broker", "--data-dir", str(data), "--consumer-offline-ms", "400"]) as proc:
        yield proc


@pytest.fixture
def client(broker: ReadyProcess) -> Iterator[RawClient]:
    c = RawClient(broker.ready["address"])
    yield c
    c.close()


def ids(frame_body: bytes) -> list[str]:
    return [decode_message(m).message_id for _s, m in split_records(frame_body)]


def pull(client: RawClient, subject: str, group: str, **extra: object) -> list[str]:
    header = {
        "subject": subject,
        "group": group,
        "consumer_id": "c1",
        "session": "s1",
        "max": 100,
        "timeout_ms": 0,
        "start": "earliest",
    }
    header.update(extra)
    resp = client.call(RequestCode.PULL, header)
    assert resp.status == Status.OK, resp.header
    return ids(bytes(resp.body))


def test_tags_are_filtered_on_the_broker(client: RawClient, subject: str) -> None:
    client.send(
        message(subject, "vip-eu", tags=("vip", "eu")), message(subject, "plain"), message(subject, "eu", tags=("eu",))
    )
    assert pull(client, subject, "or", tags=["vip", "eu"], tag_type="or") == ["vip-eu", "eu"]
    assert pull(client, subject, "and", tags=["vip", "eu"], tag_type="and") == ["vip-eu"]
    assert pull(client, subject, "all") == ["vip-eu", "plain", "eu"]
    resp = client.call(
        RequestCode.PULL,
        {
            "subject": subject,
            "group": "x",
            "consumer_id": "c",
            "session": "s",
            "max": 1,
            "tag_type": "xor",
            "tags": ["a"],
        },
    )
    assert resp.status == Status.BAD_REQUEST
    assert "'xor'" in resp.header["error"]


def test_broadcast_gives_every_consumer_every_message_from_the_latest(client: RawClient, subject: str) -> None:
    client.send(message(subject, "before"))
    header = {"subject": subject, "group": "b", "session": "s", "max": 100, "timeout_ms": 0, "broadcast": True}
    client.call(RequestCode.PULL, {**header, "consumer_id": "one"})
    client.call(RequestCode.PULL, {**header, "consumer_id": "two"})
    client.send(message(subject, "after-1"), message(subject, "after-2"))
    one = ids(bytes(client.call(RequestCode.PULL, {**header, "consumer_id": "one"}).body))
    two = ids(bytes(client.call(RequestCode.PULL, {**header, "consumer_id": "two"}).body))
    assert one == ["after-1", "after-2"]
    assert two == ["after-1", "after-2"]


def test_silent_consumer_loses_its_unacked_messages_to_retry(client: RawClient, subject: str) -> None:
    client.send(message(subject, "m1"), message(subject, "m2"))
    assert pull(client, subject, "g", consumer_id="silent") == ["m1", "m2"]
    client.call(RequestCode.ACK, {"subject": subject, "group": "g", "consumer_id": "silent", "ranges": [[0, 1]]})
    retry = f"%RETRY%{subject}%g"
    deadline = time.monotonic() + 10
    got: list[bytes] = []
    while time.monotonic() < deadline and not got:
        resp = client.call(
            RequestCode.PULL,
            {
                "subject": retry,
                "group": "g",
                "consumer_id": "other",
                "session": "s",
                "max": 10,
                "timeout_ms": 1000,
                "start": "earliest",
            },
        )
        got = [m for _s, m in split_records(bytes(resp.body))]
    assert [decode_message(m).message_id for m in got] == ["m2"]
    assert decode_message(got[0]).times == 2  # the second attempt: one failed behind it
    # the silent consumer, back with a new session, does not get m2 again
    assert pull(client, subject, "g", consumer_id="silent", session="back") == []


def test_dead_letters_are_listed_resent_and_purged(client: RawClient, subject: str) -> None:
    dead = f"%DEAD_RETRY%{subject}%g"
    props = encode_properties({"qmq.error": "ValueError: bad order"})
    letters = [
        encode_message(dead.encode(), f"d{i}".encode(), encode_tags(()), 0, props, b"x", 1, 0, 16) for i in range(3)
    ]
    assert answer_of(client.send(*letters))["errors"] == []
    listing = answer_of(client.call(RequestCode.DEAD_LETTERS, {"subject": subject, "group": "g"}))
    assert listing["total"] == 3
    first = listing["letters"][0]
    assert (first["message_id"], first["attempts"], first["error"]) == ("d0", 16, "ValueError: bad order")
    resent = client.call(RequestCode.RESEND_DEAD, {"subject": subject, "group": "g", "message_id": "d1"})
    assert resent.header == {"resent": 1}
    got = pull(client, f"%RETRY%{subject}%g", "g")
    assert got == ["d1"]
    purged = client.call(RequestCode.PURGE_DEAD, {"subject": subject, "group": "g", "all": True})
    assert purged.header == {"purged": 2}
    assert answer_of(client.call(RequestCode.DEAD_LETTERS, {"subject": subject, "group": "g"}))["total"] == 0
    refused = client.call(RequestCode.PURGE_DEAD, {"subject": subject, "group": "g"})
    assert refused.status == Status.BAD_REQUEST


def test_reset_offset_to_earliest_latest_and_a_time(client: RawClient, subject: str) -> None:
    client.send(message(subject, "a"))
    time.sleep(0.05)  # two distinct store times are the point of this test
    cut = int(time.time() * 1000)
    time.sleep(0.05)
    client.send(message(subject, "b"))
    assert pull(client, subject, "g") == ["a", "b"]
    reset = client.call(RequestCode.RESET_OFFSET, {"subject": subject, "group": "g", "to": "earliest"})
    assert reset.header["pull_offset"] == 0
    assert pull(client, subject, "g") == ["a", "b"]
    client.call(RequestCode.RESET_OFFSET, {"subject": subject, "group": "g", "to": cut})
    assert pull(client, subject, "g") == ["b"]
    client.call(RequestCode.RESET_OFFSET, {"subject": subject, "group": "g", "to": "latest"})
    assert pull(client, subject, "g") == []
    bad = client.call(RequestCode.RESET_OFFSET, {"subject": subject, "group": "g", "to": "yesterday"})
    assert bad.status == Status.BAD_REQUEST


def test_ack_many_acknowledges_several_subjects_at_once_and_refuses_by_entry(client: RawClient, subject: str) -> None:
    subjects = [f"{subject}.{i}" for i in range(3)]
    for s in subjects:
        client.send(message(s, f"{s}-1"), message(s, f"{s}-2"))
        assert pull(client, s, "g") == [f"{s}-1", f"{s}-2"]
    acks = [{"subject": s, "group": "g", "ranges": [[0, 2]]} for s in subjects]
    acks.insert(1, {"subject": subjects[0], "group": "never-pulled", "ranges": [[0, 1]]})
    acks.append("not a map")  # type: ignore[arg-type]
    resp = client.call(RequestCode.ACK_MANY, {"consumer_id": "c1", "acks": acks})
    assert resp.status == Status.OK, resp.header
    results = answer_of(resp)["results"]
    assert [r.get("ack_offset") for r in results] == [2, None, 2, 2, None]
    assert "'never-pulled' has never pulled" in results[1]["error"]
    assert "must be a map" in results[4]["error"]
    for s in subjects:
        lag = answer_of(client.call(RequestCode.LAG, {"subject": s, "group": "g"}))
        assert lag["unacked"] == 0, lag
    empty = client.call(RequestCode.ACK_MANY, {"consumer_id": "c1", "acks": []})
    assert empty.status == Status.BAD_REQUEST
    assert "non-empty list" in empty.header["error"]


def test_acks_of_positions_the_broker_never_handed_out_are_answered_as_unheld(client: RawClient, subject: str) -> None:
    # positions past a consumer's pull log: what a master since replaced handed out, or a pull
    # a power loss undid (the store's stretches); every way an ack travels says how many
    client.send(message(subject, "m1"), message(subject, "m2"))
    assert pull(client, subject, "g", consumer_id="c") == ["m1", "m2"]  # positions 0 and 1
    named = {"subject": subject, "group": "g"}
    ack = client.call(RequestCode.ACK, {**named, "consumer_id": "c", "ranges": [[0, 5]]})
    assert ack.header == {"ack_offset": 2, "unheld": 3}
    again = client.call(RequestCode.ACK, {**named, "consumer_id": "c", "ranges": [[0, 2]]})
    assert again.header == {"ack_offset": 2}  # a repeat of held positions: nothing to tell
    many = client.call(RequestCode.ACK_MANY, {"consumer_id": "c", "acks": [{**named, "ranges": [[1, 4]]}]})
    assert answer_of(many)["results"] == [{"ack_offset": 2, "unheld": 2}]
    pulled = client.call(RequestCode.PULL, {**named, "consumer_id": "c", "session": "s", "max": 1, "ack": [[7, 9]]})
    assert pulled.header["acks_unheld"] == 2
    pulled_many = client.call(
        RequestCode.PULL_MANY,
        {"consumer_id": "c", "session": "s", "max": 1, "pulls": [{**named, "max": 1, "ack": [[10, 11]]}]},
    )
    assert pulled_many.status == Status.OK, pulled_many.header
    assert pulled_many.header["results"][0]["acks_unheld"] == 1
