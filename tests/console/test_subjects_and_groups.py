"""`qmq subject create|list|delete` and `qmq group list` against a real standalone."""

from __future__ import annotations

import json

import pytest
from tests.cli.test_cli_client_commands import qmq

from qmq.client.sync import Consumer

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
