"""The API reference builds from the docstrings with one command (scripts/api_reference.py,
pdoc) without a warning or a broken reference, and documents the public SDK."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "api_reference.py"

pytestmark = pytest.mark.slow


def _build(out: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-W", "error", str(SCRIPT), str(out)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )


def test_the_reference_builds_clean_and_documents_the_sdk(tmp_path: Path) -> None:
    done = _build(tmp_path / "api")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    pages = {p.relative_to(tmp_path / "api").as_posix() for p in (tmp_path / "api").rglob("*.html")}
    assert {"index.html", "qmq.html", "qmq/aio.html", "qmq/aio/tx.html", "qmq/tx.html"} <= pages
    assert not any(p.startswith(("qmq/broker", "qmq/store", "qmq/cli")) for p in pages), pages
    blocking = (tmp_path / "api" / "qmq.html").read_text()
    for name in ("Producer", "Consumer", "ReceivedMessage", "PullConsumer", "Batch", "QmqTimeoutError"):
        assert f'id="{name}"' in blocking, name
    assert "send_timeout_ms" in blocking  # the blocking Producer's typed keywords are shown


def test_a_broken_reference_fails_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The check is real: a module whose docstring names a qmq object that does not exist."""
    (tmp_path / "qmq_doc_probe.py").write_text('"""See ``qmq.aio.NoSuchProducer``, ``qmq.aio.Producer.send``."""\n')
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None
    assert spec.loader is not None
    api_reference = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(api_reference)
    problems = api_reference.build(tmp_path / "api", ("qmq_doc_probe",))
    assert problems == ["qmq_doc_probe: its docstring names qmq.aio.NoSuchProducer, which does not exist"]
