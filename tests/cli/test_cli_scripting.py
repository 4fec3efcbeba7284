"""The `qmq` command as a script uses it, against a real standalone: `--json` on every command
that lists or reports, tables that keep every value whole when piped, exit status 0/1/2
with one line and no traceback, the meta server's base URL accepted, and what `qmq consume`
and `qmq lag` tell a new user."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from click.testing import CliRunner
from test_cli_client_commands import qmq

import qmq as sdk
from qmq.cli.main import cli, register_commands
from qmq.testing import running_standalone

register_commands()


def _json_lines(text: str) -> list[dict[str, object]]:
    return [json.loads(line) for line in text.splitlines()]


def _send(meta_server: str, subject: str, body: str = "x") -> str:
    sent = qmq("send", subject, "--body", body, meta_server=meta_server)
    assert sent.returncode == 0, sent.stderr
    return sent.stdout.strip()


@pytest.mark.integration
@pytest.mark.timeout(120)  # a dozen `qmq` processes, each a Python start: 34 s to over 60 s on a loaded 2-core machine
def test_listings_print_json(meta_server: str, subject: str) -> None:
    _send(meta_server, subject)
    read = qmq(
        "consume", subject, "--group", "g", "--from", "earliest", "--count", "1", "--json", meta_server=meta_server
    )
    assert read.returncode == 0, read.stderr
    [message] = _json_lines(read.stdout)
    assert message["subject"] == subject
    dead_id = _send(meta_server, f"%DEAD_RETRY%{subject}%g")
    _send(meta_server, f"%RETRY%{subject}%g")

    listed = qmq("subjects", "--json", meta_server=meta_server)
    assert listed.returncode == 0, listed.stderr
    by_name = {doc["subject"]: doc for doc in _json_lines(listed.stdout)}
    assert by_name[subject]["messages"] == 1
    assert by_name[subject]["consumer_groups"] == ["g"]
    assert by_name[subject]["internal"] is False
    assert sum(by_name[subject]["broker_groups"].values()) == 1  # type: ignore[attr-defined]
    assert f"%RETRY%{subject}%g" not in by_name
    assert "retry and dead-letter subject(s) not listed; --all lists them" in listed.stderr
    listed_all = qmq("subjects", "--all", "--json", meta_server=meta_server)
    everything = {doc["subject"]: doc for doc in _json_lines(listed_all.stdout)}
    assert everything[f"%RETRY%{subject}%g"]["internal"] is True

    lag = qmq("lag", subject, "--group", "g", "--json", meta_server=meta_server)
    assert lag.returncode == 0, lag.stderr
    doc = json.loads(lag.stdout)
    assert (doc["subject"], doc["group"]) == (subject, "g")
    [figures] = [f for f in doc["broker_groups"].values() if f["pull_offset"] == 1]
    assert figures["consumers_total"] == 1
    [consumer] = doc["consumers"]
    assert consumer["offline"] is False
    assert consumer["last_seen"].endswith("+00:00")
    assert consumer["ack_offset"] == 1

    dead = qmq("dead-letters", subject, "--group", "g", "--json", meta_server=meta_server)
    assert dead.returncode == 0, dead.stderr
    letters = json.loads(dead.stdout)
    assert letters["total"] == 1
    assert [letter["message_id"] for letter in letters["letters"]] == [dead_id]

    delay = qmq("delay-stats", "--json", meta_server=meta_server)
    assert delay.returncode == 0, delay.stderr
    assert json.loads(delay.stdout)["errors"] == {}

    status = qmq("cluster", "status", "--json", "--routes", "10000", meta_server=meta_server)
    assert status.returncode == 0, status.stderr
    assert subject in json.loads(status.stdout)["routes"]


@pytest.mark.integration
def test_piped_tables_print_whole_values(meta_server: str, subject: str) -> None:
    """Through `| cat`, on a 40-column 'terminal': no value is cut (rich would cut at 40)."""
    long_subject = subject + "." + "s" * 80
    dead_id = _send(meta_server, f"%DEAD_RETRY%{long_subject}%g")
    _send(meta_server, f"%RETRY%{long_subject}%g")
    env = {**os.environ, "QMQ_META_SERVER": meta_server, "COLUMNS": "40"}

    def piped(*args: str) -> list[list[str]]:
        command = " ".join(shlex.quote(a) for a in (sys.executable, "-m", "qmq", *args))
        done = subprocess.run(
            ["bash", "-o", "pipefail", "-c", f"{command} | cat"],
            capture_output=True,
            text=True,
            env=env,
            timeout=60,
        )
        assert done.returncode == 0, done.stderr
        return [line.split("\t") for line in done.stdout.splitlines()]

    rows = piped("dead-letters", long_subject, "--group", "g")
    assert rows[0] == ["broker group", "message id", "attempts", "dead since (UTC)", "last error"]
    assert [row[1] for row in rows[1:-1]] == [dead_id]
    assert any(row[0] == f"%RETRY%{long_subject}%g" for row in piped("subjects", "--all"))
    routes = piped("cluster", "status", "--routes", "10000")
    assert any(row[0] == f"%RETRY%{long_subject}%g" for row in routes)  # the routes table, tab-separated
    assert ["role", "group", "epoch", "master", "state", "writes", "slaves", "operation"] in routes
    stats = piped("delay-stats")
    assert ["bucket start (UTC)", "messages", "dispatched", "pending", "next due (UTC)", "loaded"] in stats


@pytest.mark.integration
def test_exit_status_is_0_1_or_2_with_one_line_and_no_traceback(meta_server: str, subject: str) -> None:
    _send(meta_server, subject)
    cases = [
        # usage: an unknown option, a bad value
        (["subjects", "--no-such-option"], 2, "No such option '--no-such-option'"),
        (["consume", subject, "--group", "g", "--count", "0"], 2, "Invalid value for '--count'"),
        (["send", "bad subject", "--body", "x"], 2, "'bad subject'"),
        (["subjects", "--meta-server", "127.0.0.1:1"], 2, "must be the meta server's http:// URL"),
        # failures the command reports, each named
        (["subjects", "--meta-server", "http://127.0.0.1:9/meta/address"], 1, "http://127.0.0.1:9/meta/address"),
        (["lag", f"{subject}.never", "--group", "g"], 1, f"subject '{subject}.never' is unknown"),
        (["lag", subject, "--group", "nobody"], 1, f"consumer group 'nobody' has never pulled '{subject}'"),
    ]
    for args, status, needle in cases:
        done = qmq(*args, meta_server=meta_server)
        assert done.returncode == status, (args, done.stderr)
        assert needle in done.stderr, (args, done.stderr)
        assert "Traceback" not in done.stderr, (args, done.stderr)
        assert done.stderr.strip().count("\n") <= 3, (args, done.stderr)  # click's usage hint at most


@pytest.mark.integration
def test_the_meta_servers_base_url_is_accepted_and_a_wrong_path_is_named(meta_server: str, subject: str) -> None:
    parts = urlsplit(meta_server)
    base = f"{parts.scheme}://{parts.netloc}"
    for url in (base, base + "/"):
        sent = qmq("send", subject, "--body", "via the base URL", "--meta-server", url)
        assert sent.returncode == 0, sent.stderr
    with sdk.Consumer(app_code="billing", meta_server=base) as consumer:
        pull = consumer.pull_consumer(subject, "base-url", start_from="earliest")
        assert [m.body for m in pull.pull(max_messages=10, timeout_ms=5000)] == [b"via the base URL"] * 2
    wrong = qmq("subjects", "--meta-server", base + "/meta")
    assert wrong.returncode == 2
    assert f"use {base}/meta/address as printed by `qmq ready`" in wrong.stderr
    with pytest.raises(sdk.ConfigError, match="/meta/address"):
        sdk.Producer(app_code="shop", meta_server=base + "/wrong")


@pytest.mark.integration
def test_consume_says_when_a_new_group_waits_at_the_latest_message(meta_server: str, subject: str) -> None:
    _send(meta_server, subject, "already there")
    latest = qmq("consume", subject, "--group", "late", "--idle-exit-ms", "1500", meta_server=meta_server)
    assert latest.returncode == 0, latest.stderr
    assert latest.stdout == ""
    assert f"consumer group 'late' has never pulled '{subject}', so it starts at the latest message" in latest.stderr
    assert "--from earliest" in latest.stderr
    again = qmq("consume", subject, "--group", "late", "--idle-exit-ms", "1000", meta_server=meta_server)
    assert "never pulled" not in again.stderr  # the group exists now
    earliest = qmq(
        "consume", subject, "--group", "early", "--from", "earliest", "--idle-exit-ms", "1500", meta_server=meta_server
    )
    assert "body='already there'" in earliest.stdout
    assert "never pulled" not in earliest.stderr


@pytest.mark.integration
def test_lag_shows_last_seen_and_marks_a_silent_consumer_offline(tmp_path: Path) -> None:
    offline_ms = 6_000
    with running_standalone(tmp_path / "data", {"broker": {"consumer_offline_ms": offline_ms}}) as proc:
        subject = "lag.offline"
        with sdk.Consumer(app_code="billing", meta_server=proc.meta_server, consumer_id="gone-soon") as consumer:
            consumer.pull_consumer(subject, "g", start_from="earliest").pull(max_messages=1, timeout_ms=10)
        seen_by = time.time()

        def consumer_row() -> list[str]:
            done = qmq("lag", subject, "--group", "g", meta_server=proc.meta_server)
            assert done.returncode == 0, done.stderr
            [row] = [line.split("\t") for line in done.stdout.splitlines() if line.startswith("gone-soon\t")]
            return row

        row = consumer_row()
        if time.time() - seen_by < offline_ms / 1000:  # a loaded machine may take that long to ask
            assert row[-1] == "online"
        assert row[5].startswith(time.strftime("%Y-%m-%dT", time.gmtime(seen_by)))
        deadline = time.monotonic() + offline_ms / 1000 + 20
        while consumer_row()[-1] != "offline":
            assert time.monotonic() < deadline, "the silent consumer is still shown online"
            time.sleep(0.5)  # polling a condition, bounded by the deadline
        assert json.loads(qmq("lag", subject, "--group", "g", "--json", meta_server=proc.meta_server).stdout)[
            "consumers"
        ][0]["offline"]


@pytest.mark.parametrize(
    ("command", "shape"),
    [
        (["subjects"], "JSON lines"),
        (["consume"], "JSON lines"),
        (["query"], "JSON lines"),
        (["lag"], "one JSON document"),
        (["dead-letters"], "one JSON document"),
        (["delay-stats"], "one JSON document"),
        (["cluster", "status"], "one JSON document"),
        (["trace"], "one JSON document"),
        (["report"], "one JSON document"),
        (["archive"], "one JSON document"),
    ],
)
def test_help_says_what_json_prints(command: list[str], shape: str) -> None:
    done = CliRunner().invoke(cli, [*command, "--help"], terminal_width=400)
    assert done.exit_code == 0, done.output
    [line] = [ln for ln in done.output.splitlines() if ln.strip().startswith("--json")]
    assert shape in line


def test_help_of_standalone_and_consume_says_what_they_do() -> None:
    standalone = CliRunner().invoke(cli, ["standalone", "--help"], terminal_width=400).output
    for table in ("[standalone]", "[meta]", "[broker]", "[delay]"):
        assert table in standalone
    consume = CliRunner().invoke(cli, ["consume", "--help"], terminal_width=400).output
    assert "--idle-exit-ms" in consume
    assert "starts at the latest message" in consume
