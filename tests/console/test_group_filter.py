"""`qmq group filter` against real processes: a filtered group gets only the messages its JMESPath
expression matches, the others count as consumed for it (its lag ends at 0) and never come later
(one it cannot evaluate goes to its dead letters),
another group of the subject gets every message, a bad expression is refused naming the position,
and the filter outlives a restart."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tests.cli.test_cli_client_commands import qmq

from qmq.testing import running_standalone

pytestmark = pytest.mark.integration

_APPLIED_S = 1.0  # what a broker takes at most to apply a control record (qmq.broker.controls)
_EXPR = "body.amount > `100` && properties.region == 'eu'"


def _send(subject: str, meta_server: str, body: str, *args: str) -> None:
    sent = qmq("send", subject, "--body", body, *args, meta_server=meta_server)
    assert sent.returncode == 0, sent.stderr


def _send_mix(subject: str, meta_server: str) -> None:
    _send(subject, meta_server, '{"amount": 500, "n": 1}', "--prop", "region=eu")
    _send(subject, meta_server, '{"amount": 5, "n": 2}', "--prop", "region=eu")
    _send(subject, meta_server, '{"amount": 900, "n": 3}', "--prop", "region=us")
    _send(subject, meta_server, "not json", "--prop", "region=eu")
    _send(subject, meta_server, '{"amount": 101, "n": 5}', "--prop", "region=eu")


def _consume(subject: str, meta_server: str, group: str, *args: str) -> list[str]:
    out = qmq("consume", subject, "--group", group, "--json", *args, meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    return [json.loads(line)["body"] for line in out.stdout.splitlines()]


def _backlog(subject: str, meta_server: str, group: str) -> int:
    out = qmq("lag", subject, "--group", group, "--json", meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    return sum(int(g["backlog"]) + int(g["unacked"]) for g in doc["broker_groups"].values())


def _set_filter(subject: str, meta_server: str, group: str, expr: str) -> None:
    out = qmq("group", "filter", subject, "--group", group, "--expr", expr, meta_server=meta_server)
    assert out.returncode == 0, out.stderr
    assert f"filter set: {subject} for group {group}" in out.stdout


def test_a_filtered_group_gets_only_matching_messages(meta_server: str, subject: str) -> None:
    _set_filter(subject, meta_server, "big", _EXPR)
    time.sleep(_APPLIED_S)  # the promise: applied by every broker within a second
    _send_mix(subject, meta_server)
    got = _consume(subject, meta_server, "big", "--from", "earliest", "--idle-exit-ms", "1500")
    assert [json.loads(b)["n"] for b in got] == [1, 5]
    assert len(_consume(subject, meta_server, "all", "--from", "earliest", "--count", "5")) == 5
    # the ones passed over count as consumed: they never come later and the group's lag is 0
    assert _consume(subject, meta_server, "big", "--idle-exit-ms", "1500") == []
    assert _backlog(subject, meta_server, "big") == 0
    # the body that is not JSON went to the group's dead letters with the reason
    dead = qmq("dead-letters", subject, "--group", "big", "--json", meta_server=meta_server)
    assert dead.returncode == 0, dead.stderr
    letters = json.loads(dead.stdout)["letters"]
    assert len(letters) == 1, letters
    assert "cannot evaluate it" in letters[0]["error"], letters

    cleared = qmq("group", "filter", subject, "--group", "big", "--clear", meta_server=meta_server)
    assert cleared.returncode == 0, cleared.stderr
    time.sleep(_APPLIED_S)
    _send(subject, meta_server, '{"amount": 1, "n": 6}')
    assert [json.loads(b)["n"] for b in _consume(subject, meta_server, "big", "--count", "1")] == [6]


def test_an_invalid_filter_is_refused_naming_the_position(meta_server: str, subject: str) -> None:
    out = qmq("group", "filter", subject, "--group", "g", "--expr", "body.amount >", meta_server=meta_server)
    assert out.returncode != 0
    assert "position 13" in out.stderr, out.stderr
    out = qmq("group", "filter", subject, "--group", "g", "--expr", "body ~ 1", meta_server=meta_server)
    assert out.returncode != 0
    assert "position 5" in out.stderr, out.stderr
    assert "'~'" in out.stderr, out.stderr
    out = qmq("group", "filter", subject, "--group", "g", "--expr", "a" * 5000, meta_server=meta_server)
    assert "the limit is 4096" in out.stderr, out.stderr
    out = qmq("group", "filter", subject, "--group", "g", meta_server=meta_server)
    assert "give either --expr" in out.stderr, out.stderr


def test_a_filter_outlives_a_restart(tmp_path: Path, subject: str) -> None:
    data_dir = tmp_path / "qmq-data"
    with running_standalone(data_dir) as proc:
        _set_filter(subject, proc.meta_server, "big", _EXPR)
    with running_standalone(data_dir) as proc:
        time.sleep(_APPLIED_S)  # the restarted broker has asked the meta server by now
        _send_mix(subject, proc.meta_server)
        got = _consume(subject, proc.meta_server, "big", "--from", "earliest", "--idle-exit-ms", "1500")
        assert [json.loads(b)["n"] for b in got] == [1, 5]
