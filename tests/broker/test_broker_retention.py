"""Retention on a running broker: message-log segments older than ``retention_hours`` are
deleted whole (never the one being written), with the consume-log segments whose every entry
points before what is kept; consumers, old and new, read on from the first message kept; dead
letters stay; sends go on. Here ``retention_hours`` is 0.001 (3.6 s), the smallest it takes,
with 64 KiB segments checked every 100 ms."""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from rawclient import RawClient, broker_client, message, split_records

from qmq.common.naming import dead_subject
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode, Status
from qmq.protocol.message import decode_message

pytestmark = [pytest.mark.integration, pytest.mark.slow]

RETENTION_S = 3.6
DELETED_TIMEOUT_S = RETENTION_S + 20.0  # the retention, then a loaded machine's slack
COUNT = 1_500  # about 330 KiB in records: five or six 64 KiB segments, two consume-log segments
BODY = b"x" * 160


@pytest.fixture
def broker_dir(tmp_path: Path) -> Path:
    return tmp_path / "data"  # where broker_client keeps the broker's files


@pytest.fixture
def client(tmp_path: Path) -> Iterator[RawClient]:
    settings = {
        "retention_hours": RETENTION_S / 3600,
        "retention_check_interval_ms": 100,
        "segment_bytes": 65_536,
        "consume_log_segment_entries": 1_024,
    }
    with broker_client(tmp_path, settings) as c:
        yield c


def _ids(frame_body: bytes) -> list[str]:
    return [decode_message(m).message_id for _seq, m in split_records(frame_body)]


def _pull_all(client: RawClient, subject: str, group: str) -> list[str]:
    """Pull (acknowledging) until the group has nothing more; the ids, in order."""
    got: list[str] = []
    while True:
        frame = client.pull(subject, group, max_n=500)
        assert frame.status == Status.OK, frame.header
        ids = _ids(bytes(frame.body))
        if not ids:
            return got
        got.extend(ids)
        runs = frame.header["runs"]
        client.call(
            RequestCode.ACK,
            {"subject": subject, "group": group, "consumer_id": "c1", "ranges": [[p, p + n] for p, n in runs]},
        )


def test_old_segments_are_deleted_and_consumers_read_on_from_what_is_kept(
    client: RawClient, broker_dir: Path, subject: str
) -> None:
    dead = client.send(message(dead_subject(subject, "g"), "dead-1"))
    assert answer_of(dead)["errors"] == []
    sent = [f"m-{i}" for i in range(COUNT)]
    for i in range(0, COUNT, 100):
        assert answer_of(client.send(*[message(subject, mid, BODY) for mid in sent[i : i + 100]]))["errors"] == []
    # a group that read the first messages before retention ran
    early = _ids(bytes(client.pull(subject, "early", max_n=10).body))
    assert early == sent[:10]
    log_dir = broker_dir / "log"
    [consume_dir] = [d for d in (broker_dir / "consume").iterdir() if d.is_dir()]
    segments = sorted(log_dir.iterdir())
    consume_segments = sorted(consume_dir.glob("*.cl"))
    assert len(segments) >= 4, f"the test needs several message-log segments: {segments}"
    assert len(consume_segments) == 2, f"the test needs two consume-log segments: {consume_segments}"

    deadline = time.monotonic() + DELETED_TIMEOUT_S
    while any(p.exists() for p in segments[:-1]):
        assert time.monotonic() < deadline, f"segments older than the retention are still there: {segments}"
        time.sleep(0.1)  # polling the data directory, bounded by the deadline
    assert segments[-1].exists(), "the segment being written was deleted"
    assert not consume_segments[0].exists(), "a consume-log segment pointing only at deleted messages is kept"
    assert consume_segments[1].exists()

    # A new group reads from the first message kept to the last, in order.
    kept = _pull_all(client, subject, f"late-{uuid.uuid4().hex[:6]}")
    assert kept, "nothing is kept: the active segment holds the last messages"
    assert kept == sent[len(sent) - len(kept) :]
    # The group that had read the first ten reads on from there: what is kept, nothing deleted.
    assert _pull_all(client, subject, "early") == kept
    # Dead letters are not the message log's: retention leaves them.
    letters = answer_of(client.call(RequestCode.DEAD_LETTERS, {"subject": subject, "group": "g"}))
    assert [letter["message_id"] for letter in letters["letters"]] == ["dead-1"]
    # Sends go on.
    assert answer_of(client.send(message(subject, "after")))["errors"] == []
    assert _pull_all(client, subject, "early") == ["after"]
