"""`qmq subject create|list|delete` and `qmq group list` against a real standalone."""

from __future__ import annotations

import json
import urllib.error
import urllib.parse
import urllib.request

import pytest
from tests.cli.test_cli_client_commands import qmq

from qmq.client.sync import Consumer
from qmq.common.config import meta_base_url

pytestmark = pytest.mark.integration


def test_create_list_and_delete_a_subject(meta_server: str, subject: str) -> None:
    made = qmq("subject", "create", subject, "--owner", "team-a", "--description", "orders", meta_server=meta_server)
    assert made.returncode == 0, made.stderr
    again = qmq("subject", "create", subject, "--owner", "team-b", meta_server=meta_server)
    assert again.returncode != 0
    assert f"subject {subject!r} exists already" in again.stderr
    listed = [
        json.loads(line) for line in qmq("subject", "list", "--json", meta_server=meta_server).stdout.splitlines()
    ]
    [doc] = [d for d in listed if d["subject"] == subject]
    assert (doc["owner"], doc["description"], doc["messages"]) == ("team-a", "orders", 0)
    deleted = qmq("subject", "delete", subject, meta_server=meta_server)
    assert deleted.returncode == 0, deleted.stderr
    gone = qmq("subject", "delete", subject, meta_server=meta_server)
    assert gone.returncode != 0
    assert f"no subject {subject!r} was created" in gone.stderr


def test_delete_is_refused_naming_what_is_unconsumed(meta_server: str, subject: str) -> None:
    assert qmq("subject", "create", subject, "--owner", "team-a", meta_server=meta_server).returncode == 0
    for body in ("a", "b", "c"):
        assert qmq("send", subject, "--body", body, meta_server=meta_server).returncode == 0
    assert qmq("consume", subject, "--group", "g", "--from", "earliest", "--count", "1",
               meta_server=meta_server).returncode == 0  # fmt: skip
    refused = qmq("subject", "delete", subject, meta_server=meta_server)
    assert refused.returncode != 0
    assert f"cannot delete subject {subject!r}" in refused.stderr
    assert "group 'g': 2 not pulled, 0 unacknowledged" in refused.stderr
    assert qmq("consume", subject, "--group", "g", "--count", "2", meta_server=meta_server).returncode == 0
    deleted = qmq("subject", "delete", subject, meta_server=meta_server)
    assert deleted.returncode == 0, deleted.stderr


def test_group_list_shows_consumers_and_pause(meta_server: str, subject: str) -> None:
    assert qmq("send", subject, "--body", "a", meta_server=meta_server).returncode == 0
    with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        [m] = pull.pull(max_messages=1, timeout_ms=5000)  # held, not acknowledged
        assert qmq("group", "pause", subject, "--group", "g", meta_server=meta_server).returncode == 0
        out = qmq("group", "list", subject, "--json", meta_server=meta_server)
        assert out.returncode == 0, out.stderr
        [doc] = [json.loads(line) for line in out.stdout.splitlines()]
        assert (doc["group"], doc["paused"], doc["unacked"]) == ("g", True, 1)
        [c] = doc["consumers"]
        assert c["consumer_id"] == consumer.consumer_id
        assert c["host"]
        assert consumer.consumer_id.startswith(c["host"])
        assert c["unacked"] == 1
        m.ack()
    qmq("group", "resume", subject, "--group", "g", meta_server=meta_server)


def test_group_list_shows_a_group_paused_before_it_pulled(meta_server: str, subject: str) -> None:
    assert qmq("send", subject, "--body", "a", meta_server=meta_server).returncode == 0
    assert qmq("group", "pause", subject, "--group", "later", meta_server=meta_server).returncode == 0
    out = qmq("group", "list", subject, meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("later\tpaused\tbacklog 0\tunacked 0")
    assert qmq("group", "resume", subject, "--group", "later", meta_server=meta_server).returncode == 0


def _delete(meta_server: str, subject: str, force: bool = False) -> tuple[int, dict[str, object]]:
    query = urllib.parse.urlencode({"subject": subject, "force": "true" if force else "false"})
    request = urllib.request.Request(f"{meta_base_url(meta_server)}/meta/subjects?{query}", method="DELETE")
    try:
        with urllib.request.urlopen(request, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_the_meta_server_refuses_to_delete_a_subject_with_messages_left(meta_server: str, subject: str) -> None:
    assert qmq("subject", "create", subject, "--owner", "team-a", meta_server=meta_server).returncode == 0
    # messages no group has pulled: refused over HTTP too, naming what remains
    assert qmq("send", subject, "--body", "a", meta_server=meta_server).returncode == 0
    status, doc = _delete(meta_server, subject)
    assert status == 409, doc
    assert doc["left"] == [{"group": None, "messages": 1}], doc
    assert f"cannot delete subject {subject!r}" in str(doc["error"])
    # consumed, but a delay message is pending: still refused
    assert qmq("consume", subject, "--group", "g", "--from", "earliest", "--count", "1",
               meta_server=meta_server).returncode == 0  # fmt: skip
    assert qmq("send", subject, "--body", "later", "--delay", "1h", meta_server=meta_server).returncode == 0
    refused = qmq("subject", "delete", subject, meta_server=meta_server)
    assert refused.returncode != 0
    assert "1 delay message(s) pending" in refused.stderr, refused.stderr
    # --force deletes the record all the same
    forced = qmq("subject", "delete", subject, "--force", meta_server=meta_server)
    assert forced.returncode == 0, forced.stderr
    assert "deleted: " in forced.stdout
    assert _delete(meta_server, subject)[0] == 404


def test_group_consumers_from_the_meta_server(meta_server: str, subject: str) -> None:
    assert qmq("send", subject, "--body", "a", meta_server=meta_server).returncode == 0
    assert qmq("send", subject, "--body", "b", meta_server=meta_server).returncode == 0
    with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group="seen", start_from="earliest")
        got = pull.pull(max_messages=2, timeout_ms=5000)
        assert len(got) == 2
        out = qmq("group", "consumers", subject, "--group", "seen", "--json", meta_server=meta_server)
        assert out.returncode == 0, out.stderr
        doc = json.loads(out.stdout)
        assert (doc["group"], doc["paused"], doc["unacked"], doc["truncated"]) == ("seen", False, 2, False)
        [c] = doc["consumers"]
        assert c["consumer_id"] == consumer.consumer_id
        assert consumer.consumer_id.startswith(c["host"])
        assert c["unacked"] == 2
        assert 0 < c["since_ms"] <= c["last_seen_ms"]
        text = qmq("group", "consumers", subject, "--group", "seen", meta_server=meta_server)
        assert consumer.consumer_id in text.stdout
        for m in got:
            m.ack()
    unknown = qmq("group", "consumers", subject, "--group", "nobody", meta_server=meta_server)
    assert unknown.returncode != 0
    assert "has never pulled" in unknown.stderr


def test_a_retry_waiting_for_its_back_off_keeps_a_subject(meta_server: str, subject: str) -> None:
    assert qmq("subject", "create", subject, "--owner", "team-a", meta_server=meta_server).returncode == 0
    assert qmq("send", subject, "--body", "fails", meta_server=meta_server).returncode == 0
    with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group="g", start_from="earliest")
        [m] = pull.pull(max_messages=1, timeout_ms=5000)
        m.nack()  # comes back after the group's back-off (5 s), held by the delay server meanwhile
        consumer.flush_acks()
    status, doc = _delete(meta_server, subject)
    assert status == 409, doc
    # the original is acknowledged: only the retry copy, waiting on a delay server, remains
    assert [x["delay_pending"] for x in doc["left"]] == [1], doc
