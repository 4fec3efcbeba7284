"""qmq as a user installs it: the sdist and the wheel built with ``python -m build``, the
wheel installed with no extras in a fresh venv (the client SDK alone, which sends and
receives through a server of the full install), then with extras: the ``qmq`` command names
the extra a sub-command lacks, and with ``qmq[all]`` runs ``qmq standalone --demo``.

The venvs install from the machine's package index with the versions of constraints.txt
(pip's cache holds them after the suite's own install): about 4 s for the client alone,
15 s for ``qmq[all]`` with PySpark, 3 s for ``python -m build``, here.
"""

from __future__ import annotations

import subprocess
import sys
import tarfile
import time
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

from qmq import __version__
from qmq.testing.processes import start_ready

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
# What the client SDK must not bring: the extras' packages.
NOT_IN_CLIENT = ("numpy", "sqlalchemy", "click", "rich", "prometheus_client", "uvloop", "pandas", "pyarrow", "pyspark")
_PIP_S = 180
_BUILD_S = 180

# Run in the client-only venv: every module of the client SDK imports, nothing of the extras
# is there, and a message goes through the blocking SDK (asyncio's event loop: no uvloop).
CLIENT_SCRIPT = """
import importlib, importlib.util, pkgutil, sys
import qmq, qmq.aio, qmq.client, qmq.common, qmq.protocol, qmq.idempotency
for package in (qmq.client, qmq.common, qmq.protocol):
    for info in pkgutil.iter_modules(package.__path__, package.__name__ + "."):
        importlib.import_module(info.name)
present = [name for name in sys.argv[3].split(",") if importlib.util.find_spec(name) is not None]
assert not present, f"the client-only install has {present}"
meta_server, subject = sys.argv[1], sys.argv[2]
with qmq.Producer(app_code="pkg", meta_server=meta_server) as producer, qmq.Consumer(
    app_code="pkg", meta_server=meta_server
) as consumer:
    pull = consumer.pull_consumer(subject, "pkg", start_from="earliest")
    sent = producer.generate_message(subject)
    sent.body = "from a client-only install"
    producer.send(sent)
    [got] = pull.pull(max_messages=10, timeout_ms=10_000)
    got.ack()
    assert got.message_id == sent.message_id, (got.message_id, sent.message_id)
    print("received", got.body.decode())
"""


def _run(argv: list[str | Path], timeout_s: float, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=timeout_s, cwd=cwd)


def _check(argv: list[str | Path], timeout_s: float, cwd: Path) -> str:
    done = _run(argv, timeout_s, cwd)
    assert done.returncode == 0, f"{argv} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def _fresh_venv(path: Path) -> Path:
    _check([sys.executable, "-m", "venv", path], _PIP_S, path.parent)
    return path / "bin"


def _pip_install(bin_dir: Path, requirement: str) -> None:
    _check(
        [
            bin_dir / "python",
            "-m",
            "pip",
            "install",
            "--disable-pip-version-check",
            "-c",
            ROOT / "constraints.txt",
            requirement,
        ],
        _PIP_S,
        bin_dir.parent,
    )


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    _check([sys.executable, "-m", "build", "--outdir", out, ROOT], _BUILD_S, out)
    return out


@pytest.fixture(scope="module")
def wheel(dist: Path) -> Path:
    [path] = dist.glob("qmq-*-py3-none-any.whl")
    return path


@pytest.mark.timeout(_BUILD_S)
def test_the_sdist_and_wheel_carry_the_package_its_version_and_its_extras(dist: Path, wheel: Path) -> None:
    [sdist] = dist.glob("qmq-*.tar.gz")
    assert sdist.name == f"qmq-{__version__}.tar.gz"
    with tarfile.open(sdist) as tar:
        names = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}
    assert {"pyproject.toml", "README.md", "src/qmq/__init__.py", "src/qmq/py.typed"} <= names
    with zipfile.ZipFile(wheel) as zf:
        files = set(zf.namelist())
        metadata = Parser().parsestr(zf.read(f"qmq-{__version__}.dist-info/METADATA").decode())
        entry_points = zf.read(f"qmq-{__version__}.dist-info/entry_points.txt").decode()
    assert {"qmq/__init__.py", "qmq/py.typed", "qmq/client/sync.py", "qmq/broker/server.py"} <= files
    assert not [name for name in files if name.startswith("tests/")]
    assert metadata["Version"] == __version__
    assert metadata["Requires-Python"] == ">=3.11"
    assert set(metadata.get_all("Provides-Extra") or []) >= {"server", "cli", "tx", "spark", "all", "test", "bench"}
    base = sorted(r.split(">")[0].split("=")[0] for r in metadata.get_all("Requires-Dist") or [] if ";" not in r)
    assert base == ["aiohttp", "crc32c", "msgpack", "yarl"], base
    assert "Programming Language :: Python :: 3.13" in (metadata.get_all("Classifier") or [])
    assert "qmq = qmq.__main__:main" in entry_points


@pytest.mark.smoke
@pytest.mark.timeout(_BUILD_S + 2 * _PIP_S)
def test_the_wheel_alone_is_a_client_that_sends_and_receives(
    wheel: Path, tmp_path: Path, meta_server: str, subject: str
) -> None:
    bin_dir = _fresh_venv(tmp_path / "client")
    _pip_install(bin_dir, str(wheel))
    script = tmp_path / "client.py"
    script.write_text(CLIENT_SCRIPT, encoding="utf-8")
    out = _check([bin_dir / "python", script, meta_server, subject, ",".join(NOT_IN_CLIENT)], 60, tmp_path)
    assert out == "received from a client-only install\n"
    # the console script is there, and without the cli extra it says which extra to install
    done = _run([bin_dir / "qmq", "standalone"], 60, tmp_path)
    assert (done.returncode, done.stdout) == (1, "")
    assert "pip install 'qmq[cli]'" in done.stderr
    assert len(done.stderr.splitlines()) == 1, done.stderr


@pytest.mark.timeout(_BUILD_S + 3 * _PIP_S)
def test_each_command_names_its_missing_extra_and_all_extras_run_the_demo(wheel: Path, tmp_path: Path) -> None:
    bin_dir = _fresh_venv(tmp_path / "cli")
    _pip_install(bin_dir, f"{wheel}[cli]")
    assert _check([bin_dir / "qmq", "--version"], 60, tmp_path) == f"qmq, version {__version__}\n"
    for argv, extra in [
        (["standalone", "--data-dir", tmp_path / "d"], "server"),
        (["cluster", "up", "--data-dir", tmp_path / "c"], "server"),
        (["archive", "--help"], None),
        (["archive", "--to", tmp_path / "a"], "spark"),
        (["report", "--archive", tmp_path / "a"], "spark"),
        (["tx", "init", "--db", "sqlite://"], "tx"),
    ]:
        done = _run([bin_dir / "qmq", *argv], 60, tmp_path)
        if extra is None:
            assert done.returncode == 0, done.stderr
            continue
        assert done.returncode == 1, (argv, done.stderr)
        assert done.stderr.endswith(f"pip install 'qmq[{extra}]'\n"), (argv, done.stderr)
        assert len(done.stderr.splitlines()) == 1, done.stderr

    _pip_install(bin_dir, f"{wheel}[all]")
    data_dir = tmp_path / "qmq-data"
    proc = start_ready(
        [
            str(bin_dir / "qmq"),
            "standalone",
            "--data-dir",
            str(data_dir),
            "--meta-port",
            "0",
            "--broker-port",
            "0",
            "--demo",
        ]
    )
    try:
        assert proc.proc.stdout is not None
        lines: list[str] = []
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not (lines and lines[-1].startswith("demo: done")):
            line = proc.proc.stdout.readline().decode()
            if not line:
                break
            lines.append(line)
        text = "".join(lines)
        assert "demo: sent" in text
        assert "demo: consumed" in text
        assert "demo: done" in text
    finally:
        assert proc.stop() == 0
