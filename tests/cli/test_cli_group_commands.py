"""`qmq reset-offset`, `qmq dead-letters`, `qmq resend-dead`, `qmq purge-dead` against a real standalone."""

from __future__ import annotations

import pytest
from test_cli_client_commands import qmq

pytestmark = pytest.mark.integration


def test_reset_offset_replays_a_group(meta_server: str, subject: str) -> None:
    for body in ("a", "b"):
        qmq("send", subject, "--body", body, meta_server=meta_server)
    first = qmq("consume", subject, "--group", "g", "--from", "earliest", "--count", "2", meta_server=meta_server)
    assert first.returncode == 0, first.stderr
    reset = qmq("reset-offset", subject, "--group", "g", "--to", "earliest", meta_server=meta_server)
    assert reset.returncode == 0, reset.stderr
    assert "pull offset 2 -> 0" in reset.stdout
    again = qmq("consume", subject, "--group", "g", "--count", "2", meta_server=meta_server)
    assert "body='a'" in again.stdout
    assert "body='b'" in again.stdout


def test_reset_offset_refuses_a_time_without_offset(meta_server: str, subject: str) -> None:
    out = qmq("reset-offset", subject, "--group", "g", "--to", "2026-11-21T10:00:00", meta_server=meta_server)
    assert out.returncode != 0
    assert "no UTC offset" in out.stderr


def test_reset_offset_names_a_time_before_1970_and_the_range(meta_server: str, subject: str) -> None:
    out = qmq("reset-offset", subject, "--group", "g", "--to", "0001-01-01T00:00:00Z", meta_server=meta_server)
    assert out.returncode == 2
    assert "'0001-01-01T00:00:00Z' is before 1970-01-01T00:00:00Z" in out.stderr
    assert "-62135596800000" not in out.stderr


def test_dead_letters_list_resend_and_purge(meta_server: str, subject: str) -> None:
    dead = f"%DEAD_RETRY%{subject}%g"
    sent = [qmq("send", dead, "--prop", "qmq.error=boom", "--body", f"x{i}", meta_server=meta_server) for i in range(2)]
    ids = [s.stdout.strip() for s in sent]
    listing = qmq("dead-letters", subject, "--group", "g", meta_server=meta_server)
    assert listing.returncode == 0, listing.stderr
    assert "2 dead letter(s)" in listing.stdout
    assert "boom" in listing.stdout
    resend = qmq("resend-dead", subject, "--group", "g", "--message-id", ids[0], meta_server=meta_server)
    assert "resent 1 dead letter(s)" in resend.stdout
    retry = qmq(
        "consume",
        f"%RETRY%{subject}%g",
        "--group",
        "g",
        "--from",
        "earliest",
        "--count",
        "1",
        "--json",
        meta_server=meta_server,
    )
    assert ids[0] in retry.stdout
    purge = qmq("purge-dead", subject, "--group", "g", "--all", meta_server=meta_server)
    assert "purged 1 dead letter(s)" in purge.stdout
    assert "0 dead letter(s)" in qmq("dead-letters", subject, "--group", "g", meta_server=meta_server).stdout
    both = qmq("purge-dead", subject, "--group", "g", meta_server=meta_server)
    assert both.returncode != 0
    assert "exactly one of --message-id ID or --all" in both.stderr
