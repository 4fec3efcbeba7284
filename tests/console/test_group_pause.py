"""`qmq group pause|resume|paused` against real processes: a paused group's consumers get nothing,
nothing is lost, progress is kept, a resume holds within a second, and a pause outlives restarts."""

from __future__ import annotations

import json
import time
import urllib.request
from pathlib import Path

import pytest
from tests.cli.test_cli_client_commands import qmq

from qmq.client.sync import Consumer
from qmq.testing import running_standalone

pytestmark = pytest.mark.integration

_APPLIED_S = 1.0  # what a broker takes at most to apply a pause or resume (qmq.broker.controls)


def _send(subject: str, meta_server: str, *bodies: str) -> None:
    for body in bodies:
        sent = qmq("send", subject, "--body", body, meta_server=meta_server)
        assert sent.returncode == 0, sent.stderr


def _consume(subject: str, meta_server: str, *args: str) -> list[str]:
    out = qmq("consume", subject, "--group", "g", "--json", *args, meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["body"] for line in out.stdout.splitlines()]


def test_a_paused_group_gets_nothing_and_resumes_within_a_second(meta_server: str, subject: str) -> None:
    _send(subject, meta_server, "a", "b", "c")
    assert _consume(subject, meta_server, "--from", "earliest", "--count", "1") == ["a"]
    paused = qmq("group", "pause", subject, "--group", "g", meta_server=meta_server)
    assert paused.returncode == 0, paused.stderr
    assert f"paused: {subject} for group g" in paused.stdout
    assert qmq("group", "paused", meta_server=meta_server).stdout.count(f"{subject}\tg") == 1
    time.sleep(_APPLIED_S)  # the promise under test: applied by the broker within a second
    _send(subject, meta_server, "d")
    assert _consume(subject, meta_server, "--idle-exit-ms", "1500") == []
    other = qmq("consume", subject, "--group", "other", "--from", "earliest", "--count", "4", meta_server=meta_server)
    assert other.returncode == 0, other.stderr  # only the paused group is held back

    with Consumer(app_code="test", meta_server=meta_server) as consumer:
        pull = consumer.pull_consumer(subject, group="g")
        assert pull.pull(max_messages=10, timeout_ms=300) == []  # a long poll of a paused group: parked, empty
        resumed = qmq("group", "resume", subject, "--group", "g", meta_server=meta_server)
        assert resumed.returncode == 0, resumed.stderr
        start = time.monotonic()
        got: list[str] = []
        first_s = 0.0
        while len(got) < 3 and time.monotonic() - start < 10:
            for m in pull.pull(max_messages=10, timeout_ms=5000):
                first_s = first_s or time.monotonic() - start
                got.append(m.body.decode())
                m.ack()
    assert got == ["b", "c", "d"]  # nothing lost, progress kept: "a" was acknowledged before the pause
    assert first_s < _APPLIED_S + 0.5
    assert f"{subject}\tg" not in qmq("group", "paused", meta_server=meta_server).stdout


def test_pause_refuses_a_bad_group_naming_it(meta_server: str, subject: str) -> None:
    out = qmq("group", "pause", subject, "--group", "a b", meta_server=meta_server)
    assert out.returncode != 0
    assert "consumer group 'a b' contains ' '" in out.stderr
    req = urllib.request.Request(
        meta_server.replace("/meta/address", "/meta/controls/pause"), data=b"[1]", method="POST"
    )
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=10)
    assert err.value.code == 400
    assert "the body must be a JSON object" in err.value.read().decode()
    err.value.close()


def test_a_pause_outlives_a_restart(tmp_path: Path, subject: str) -> None:
    data_dir = tmp_path / "qmq-data"
    with running_standalone(data_dir) as proc:
        _send(subject, proc.meta_server, "a")
        assert _consume(subject, proc.meta_server, "--from", "earliest", "--count", "1") == ["a"]
        assert qmq("group", "pause", subject, "--group", "g", meta_server=proc.meta_server).returncode == 0
        _send(subject, proc.meta_server, "b")
    with running_standalone(data_dir) as proc:
        assert f"{subject}\tg" in qmq("group", "paused", meta_server=proc.meta_server).stdout
        time.sleep(_APPLIED_S)  # the restarted broker has asked the meta server by now
        assert _consume(subject, proc.meta_server, "--idle-exit-ms", "1500") == []
        assert qmq("group", "resume", subject, "--group", "g", meta_server=proc.meta_server).returncode == 0
        assert _consume(subject, proc.meta_server, "--count", "1") == ["b"]
