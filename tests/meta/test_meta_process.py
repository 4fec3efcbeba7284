"""``run_meta`` as its own process: the ready line, a clean exit on SIGTERM/SIGINT, and exit
status 3 with one line on stderr when it cannot start."""

from __future__ import annotations

import json
import re
import selectors
import signal
import socket
import subprocess
import sys
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

# Interpreter start and imports on a busy 2-core machine; the wait ends as soon as the line comes.
READY_DEADLINE_S = 30.0
EXIT_DEADLINE_S = 15.0
READY = re.compile(
    r"^qmq ready role=meta meta_server=(http://127\.0\.0\.1:(\d+)/meta/address) http=(\S+) console=(\S+)$"
)


def _start(data_dir: Path, port: int = 0) -> subprocess.Popen[str]:
    code = (
        "import sys; from pathlib import Path; "
        "from qmq.common.config import MetaConfig; from qmq.meta import run_meta; "
        f"sys.exit(run_meta(MetaConfig(data_dir=Path({str(data_dir)!r}), host='127.0.0.1', port={port})))"
    )
    return subprocess.Popen(
        [sys.executable, "-W", "error", "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )


def _read_line(proc: subprocess.Popen[str], deadline_s: float) -> str:
    """The first stdout line, waiting for it at most ``deadline_s``; "" if the process closed stdout."""
    assert proc.stdout is not None
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=deadline_s):
            raise AssertionError(f"no line on stdout within {deadline_s} s")
    return proc.stdout.readline()


@pytest.fixture
def meta_process(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    proc = _start(tmp_path / "meta")
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.communicate(timeout=EXIT_DEADLINE_S)


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_prints_the_ready_line_serves_and_exits_0_on_a_signal(
    meta_process: subprocess.Popen[str], sig: signal.Signals
) -> None:
    line = _read_line(meta_process, READY_DEADLINE_S)
    match = READY.match(line.rstrip("\n"))
    if not match:
        meta_process.kill()
        _, err = meta_process.communicate(timeout=EXIT_DEADLINE_S)
        raise AssertionError(f"not a ready line: {line!r}; stderr: {err}")
    meta_server, port, http, console = match.groups()
    assert http == f"http://127.0.0.1:{port}"
    assert console == f"http://127.0.0.1:{port}/console/"

    with urllib.request.urlopen(meta_server, timeout=10) as resp:
        view = json.load(resp)
    assert view["broker_groups"] == []
    assert view["routes"] == {}

    meta_process.send_signal(sig)
    out, err = meta_process.communicate(timeout=EXIT_DEADLINE_S)
    assert meta_process.returncode == 0
    assert out == ""  # nothing after the ready line
    assert "Traceback" not in err


def test_a_port_in_use_exits_3_with_one_line_naming_it(tmp_path: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = _start(tmp_path / "meta", port)
        out, err = proc.communicate(timeout=READY_DEADLINE_S)
    assert proc.returncode == 3
    assert out == ""
    assert err.splitlines() == [
        f"qmq meta: cannot start: cannot listen on 127.0.0.1:{port}: the port is in use; "
        "stop what uses it or choose another port (0 picks a free one)"
    ]


def test_an_unusable_data_dir_exits_3_with_one_line_naming_it(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    proc = _start(not_a_dir)
    out, err = proc.communicate(timeout=READY_DEADLINE_S)
    assert proc.returncode == 3
    assert out == ""
    [line] = err.splitlines()
    assert line.startswith(f"qmq meta: cannot start: data_dir {str(not_a_dir)!r} cannot be used")
