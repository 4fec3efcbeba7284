"""``/health`` of every role tells alive from ready: ``?probe=live`` answers 200 while the process
serves, ``?probe=ready`` 200 only once it has recovered and registered (503 before)."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from qmq.testing import ReadyProcess, running_role
from qmq.testing.processes import qmq_argv

pytestmark = pytest.mark.integration


def get(url: str) -> tuple[int, dict[str, object]]:
    try:
        with urllib.request.urlopen(url, timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def health_urls(standalone: ReadyProcess) -> dict[str, str]:
    meta = standalone.meta_server.removesuffix("/meta/address")
    return {
        "meta": f"{meta}/health",
        "broker": f"{standalone.ready['broker_http']}/health",
        "delay": f"{standalone.ready['delay_http']}/health",
        "gateway": f"{standalone.gateway}/health",
    }


def test_every_role_of_a_standalone_is_alive_and_ready(shared_standalone: ReadyProcess) -> None:
    for role, url in health_urls(shared_standalone).items():
        for probe in ("live", "ready"):
            status, body = get(f"{url}?probe={probe}")
            assert (status, body["alive"], body["ready"]) == (200, True, True), (role, probe, body)
        status, body = get(url)
        assert status == 200, (role, body)
        status, body = get(f"{url}?probe=started")
        assert status == 400, role
        assert "probe='started' is unknown" in str(body["error"])


def _free_port() -> int:
    # the broker's HTTP port must be known before its ready line, which comes only once registered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _until(what: str, check: object, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what} within {timeout_s} s"
        time.sleep(0.05)  # polling the server's own answer


@pytest.mark.timeout(150)
def test_a_broker_is_alive_but_not_ready_until_its_meta_server_answers(tmp_path: Path) -> None:
    meta_port, http_port = _free_port(), _free_port()
    meta_url = f"http://127.0.0.1:{meta_port}/meta/address"
    health = f"http://127.0.0.1:{http_port}/health"
    broker = subprocess.Popen(
        qmq_argv(
            "broker", "--data-dir", str(tmp_path / "broker"), "--host", "127.0.0.1", "--port", "0",
            "--http-port", str(http_port), "--meta-server", meta_url,
        ),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        def answers() -> bool:
            try:
                return get(f"{health}?probe=live")[0] == 200
            except OSError:
                return False

        _until("the broker's HTTP port answers", answers)
        status, body = get(f"{health}?probe=ready")
        assert (status, body["alive"], body["ready"]) == (503, True, False)
        assert get(health)[0] == 200, "it works: only not registered yet"
        with running_role(["meta", "--data-dir", str(tmp_path / "meta"), "--port", str(meta_port)]):
            _until("the broker is ready once registered", lambda: get(f"{health}?probe=ready")[0] == 200)
    finally:
        broker.terminate()
        broker.wait(30)
