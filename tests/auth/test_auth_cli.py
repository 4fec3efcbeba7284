"""`qmq auth hash`: the secret from stdin or --secret, the value alone on one line."""

from __future__ import annotations

import subprocess
import sys

from qmq.auth.secrets import parse_secret_hash, secret_matches


def qmq_auth_hash(*args: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "qmq", "auth", "hash", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hash_reads_stdin_and_prints_the_value_alone() -> None:
    done = qmq_auth_hash(stdin="s3cret\n")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert secret_matches("s3cret", parse_secret_hash(line, "stdout"))


def test_hash_takes_the_secret_as_an_option() -> None:
    done = qmq_auth_hash("--secret", "other")
    assert done.returncode == 0, done.stderr
    assert secret_matches("other", parse_secret_hash(done.stdout.strip(), "stdout"))


def test_an_empty_stdin_is_a_usage_error() -> None:
    done = qmq_auth_hash(stdin="")
    assert done.returncode == 2
    assert "no secret on stdin" in done.stderr
    assert "Traceback" not in done.stderr
