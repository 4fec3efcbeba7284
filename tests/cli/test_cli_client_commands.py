"""`qmq send`, `qmq consume`, `qmq subjects`, `qmq lag` driven as a user would, against a real standalone."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.integration


def qmq(*args: str, meta_server: str | None = None, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    env.pop("QMQ_META_SERVER", None)
    if meta_server:
        env["QMQ_META_SERVER"] = meta_server
    return subprocess.run(
        [sys.executable, "-m", "qmq", *args], capture_output=True, text=True, input=stdin, env=env, timeout=60
    )


@pytest.mark.smoke
def test_send_then_consume_as_json(meta_server: str, subject: str) -> None:
    sent = qmq("send", subject, "--prop", "orderId=42", "--tag", "vip", "--body", "hello", meta_server=meta_server)
    assert sent.returncode == 0, sent.stderr
    message_id = sent.stdout.strip()
    piped = qmq("send", subject, "-", meta_server=meta_server, stdin="from stdin")
    assert piped.returncode == 0, piped.stderr
    out = qmq(
        "consume", subject, "--group", "g", "--from", "earliest", "--count", "2", "--json", meta_server=meta_server
    )
    assert out.returncode == 0, out.stderr
    docs = [json.loads(line) for line in out.stdout.splitlines()]
    assert docs[0]["message_id"] == message_id
    assert docs[0]["properties"] == {"orderId": "42"}
    assert docs[0]["tags"] == ["vip"]
    assert docs[0]["body"] == "hello"
    assert docs[1]["body"] == "from stdin"


def test_consume_acks_so_the_group_moves_on(meta_server: str, subject: str) -> None:
    for body in ("one", "two"):
        assert qmq("send", subject, "--body", body, meta_server=meta_server).returncode == 0
    first = qmq("consume", subject, "--group", "g", "--from", "earliest", "--count", "1", meta_server=meta_server)
    second = qmq("consume", subject, "--group", "g", "--count", "1", "--idle-exit-ms", "3000", meta_server=meta_server)
    assert "body='one'" in first.stdout
    assert "body='two'" in second.stdout
    lag = qmq("lag", subject, "--group", "g", meta_server=meta_server)
    assert lag.returncode == 0, lag.stderr
    assert "broker-1" in lag.stdout


def test_subjects_lists_messages_and_groups(meta_server: str, subject: str) -> None:
    qmq("send", subject, "--body", "x", meta_server=meta_server)
    qmq("consume", subject, "--group", "listing", "--from", "earliest", "--count", "1", meta_server=meta_server)
    out = qmq("subjects", meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    line = next(line for line in out.stdout.splitlines() if subject in line)
    assert "listing" in line


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (["send", "bad subject", "--body", "x"], "'bad subject'"),
        (["send", "s", "--prop", "noequals"], "'noequals' is not k=v"),
        (["send", "s", "--body", "a", "-"], "give the body once"),
        (["lag", "never.seen", "--group", "g"], "subject 'never.seen' is unknown"),
    ],
)
def test_errors_name_the_value_and_exit_nonzero(meta_server: str, args: list[str], needle: str) -> None:
    out = qmq(*args, meta_server=meta_server)
    assert out.returncode != 0
    assert needle in out.stderr
    assert "Traceback" not in out.stderr


def test_unreachable_meta_server_is_named() -> None:
    out = qmq("send", "s", "--body", "x", "--meta-server", "http://127.0.0.1:9/meta/address")
    assert out.returncode == 1
    assert "http://127.0.0.1:9/meta/address" in out.stderr
    assert "Traceback" not in out.stderr


def test_missing_meta_server_says_what_to_do() -> None:
    out = qmq("subjects")
    assert out.returncode == 2
    assert "--meta-server" in out.stderr
