"""The standalone supervisor: one child process per role, started in order, stopped in order.

The meta server starts first; the broker starts with its URL and registers, then the delay
server (data in ``DATA_DIR/delay``) does the same, then the HTTP gateway (no data). When all
have printed their ready lines, the supervisor prints its own::

    qmq ready meta_server=http://HOST:PORT/meta/address broker=HOST:PORT meta_pid=N broker_pid=N
              delay=HOST:PORT delay_pid=N data_dir=DIR
              broker_http=http://HOST:PORT delay_http=http://HOST:PORT
              gateway=http://HOST:PORT gateway_pid=N
              console=http://HOST:PORT/console/                            (one line)

``broker_http`` and ``delay_http`` serve each role's Prometheus ``/metrics``.

Children get ``PR_SET_PDEATHSIG`` = SIGTERM, so they stop when the supervisor dies, even by
``kill -9``. A child that dies on its own is restarted (at most ``restarts_max`` times in
``restart_window_ms``, by default 3 in a minute; a restart that dies before its ready line counts
as one more); past that the supervisor stops the rest and exits 1.
"""

from __future__ import annotations

import ctypes
import logging
import logging.handlers
import os
import select
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from qmq.common.config import StandaloneConfig

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_STOP_TIMEOUT_S = 30.0
_STOPS = {signal.SIGTERM, signal.SIGINT}
_SIGNALS = {*_STOPS, signal.SIGCHLD}


class StartupFailed(Exception):
    pass


def _child_setup(parent_pid: int) -> Callable[[], None]:
    def setup() -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, _SIGNALS)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent_pid:  # the parent died before prctl took effect
            os._exit(1)

    return setup


@dataclass
class Child:
    role: str
    argv: list[str]
    proc: subprocess.Popen[bytes] | None = None
    ready: dict[str, str] = field(default_factory=dict)
    restarts: list[float] = field(default_factory=list)

    def start(self, deadline: float) -> None:
        self.launch()
        self.wait_ready(deadline)

    def launch(self) -> None:
        """Start the process; ``wait_ready`` waits for its ready line."""
        self.proc = subprocess.Popen(
            self.argv,
            stdout=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            env=_child_env(self.role),
            preexec_fn=_child_setup(os.getpid()),
        )

    def wait_ready(self, deadline: float) -> None:
        assert self.proc is not None, "launch() first"
        self.ready = _wait_ready(self.proc, self.role, deadline)
        # keep draining stdout so a chatty child can never block on a full pipe
        threading.Thread(target=_drain, args=(self.proc,), daemon=True, name=f"drain-{self.role}").start()

    def stop(self) -> int | None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return proc.returncode if proc else None
        proc.send_signal(signal.SIGTERM)
        try:
            return proc.wait(_STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.error("%s (pid %d) did not stop within %.0f s; killing it", self.role, proc.pid, _STOP_TIMEOUT_S)
            proc.kill()
            return proc.wait()


def _child_env(role: str) -> dict[str, str]:
    """The environment of a role's process: when the supervisor logs to a file (``--log-file``),
    each role logs to its own beside it (FILE-meta.log, FILE-broker.log, FILE-delay.log):
    rotation is per process."""
    env = dict(os.environ)
    env.pop("QMQ_LOG_FILE", None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.handlers.RotatingFileHandler):
            path = Path(handler.baseFilename)
            name = role.split()[0]  # "meta server" -> meta
            env["QMQ_LOG_FILE"] = str(path.with_name(f"{path.stem}-{name}{path.suffix}"))
    return env


def _wait_ready(proc: subprocess.Popen[bytes], role: str, deadline: float) -> dict[str, str]:
    assert proc.stdout is not None
    fd = proc.stdout.fileno()
    buf = b""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            proc.kill()
            proc.wait()
            proc.stdout.close()
            raise StartupFailed(f"the {role} did not report ready in time; see its log above")
        readable, _, _ = select.select([fd], [], [], left)
        if not readable:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            code = proc.wait()
            proc.stdout.close()
            raise StartupFailed(f"the {role} exited with status {code} before it was ready; see its log above")
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            text = line.decode("utf-8", "replace")
            if text.startswith("qmq ready"):
                return dict(part.split("=", 1) for part in text.split()[2:] if "=" in part)


def _drain(proc: subprocess.Popen[bytes]) -> None:
    assert proc.stdout is not None
    with proc.stdout:  # closed at the child's end: a restarted role's old pipe is not left to the GC
        while proc.stdout.read(65536):
            pass


class Supervisor:
    def __init__(self, config: StandaloneConfig, config_file: Path | None, demo: bool = False) -> None:
        self.config = config
        self.config_file = config_file
        self.demo = demo
        data = Path(config.data_dir)
        common = ["--host", config.host] + (["--config", str(config_file)] if config_file else [])
        # the roles with auth (the gateway keeps its own options): the file, the servers' own app, --insecure
        auth = [*(["--auth-file", config.auth_file] if config.auth_file else []), *(["--insecure"] * config.insecure)]
        for flag, value in (
            ("--tls-cert", config.tls_cert),
            ("--tls-key", config.tls_key),
            ("--tls-ca", config.tls_ca),
        ):
            if value:
                auth += [flag, value]
        servers = [*auth, *(["--app-code", config.app_code] if config.app_code else [])]
        qmq = [sys.executable, "-m", "qmq"]
        self.meta = Child(
            "meta server",
            [*qmq, "meta", "--data-dir", str(data / "meta"), "--port", str(config.meta_port), *common, *auth],
        )
        self.broker_argv = [
            *qmq,
            "broker",
            "--data-dir",
            str(data / "broker"),
            "--port",
            str(config.broker_port),
            *common,
            *servers,
        ]
        self.broker = Child("broker", [])
        self.delay_argv = [
            *qmq,
            "delay",
            "--data-dir",
            str(data / "delay"),
            "--port",
            str(config.delay_port),
            *common,
            *servers,
        ]
        self.delay = Child("delay server", [])
        self.gateway_argv = [*qmq, "gateway", "--port", str(config.gateway_port), *common, *servers]
        self.gateway = Child("gateway", [])
        self.children = [self.meta, self.broker, self.delay, self.gateway]

    def run(self) -> int:
        signal.pthread_sigmask(signal.SIG_BLOCK, _SIGNALS)
        deadline = time.monotonic() + self.config.ready_timeout_ms / 1000
        try:
            self.meta.start(deadline)
            meta_url = self.meta.ready["meta_server"]
            self.broker.argv = [*self.broker_argv, "--meta-server", meta_url]
            self.delay.argv = [*self.delay_argv, "--meta-server", meta_url]
            self.gateway.argv = [*self.gateway_argv, "--meta-server", meta_url]
            # The gateway needs only the meta server: it starts while the broker recovers its
            # store (seconds with tens of thousands of subjects), not after.
            self.broker.launch()
            self.gateway.launch()
            self.broker.wait_ready(deadline)
            # after the broker: due messages are handed to it as soon as the delay server runs
            self.delay.start(deadline)
            self.gateway.wait_ready(deadline)
        except StartupFailed as exc:
            print(f"qmq standalone: cannot start: {exc}", file=sys.stderr, flush=True)
            self._stop_all()
            return 3
        assert self.meta.proc is not None
        assert self.broker.proc is not None
        assert self.delay.proc is not None
        assert self.gateway.proc is not None
        print(
            f"qmq ready meta_server={meta_url} broker={self.broker.ready.get('address', '?')} "
            f"meta_pid={self.meta.proc.pid} broker_pid={self.broker.proc.pid} "
            f"delay={self.delay.ready.get('address', '?')} delay_pid={self.delay.proc.pid} "
            f"data_dir={self.config.data_dir} broker_http={self.broker.ready.get('http', '?')} "
            f"delay_http={self.delay.ready.get('http', '?')} "
            f"gateway={self.gateway.ready.get('gateway', '?')} gateway_pid={self.gateway.proc.pid} "
            f"console={self.meta.ready.get('console', '?')}",
            flush=True,
        )
        if self.demo:
            threading.Thread(target=_run_demo, args=(meta_url,), daemon=True, name="demo").start()
        return self._supervise()

    def _supervise(self) -> int:
        while True:
            info = signal.sigwaitinfo(_SIGNALS)
            if info.si_signo in (signal.SIGTERM, signal.SIGINT):
                log.info("standalone: stopping (signal %d)", info.si_signo)
                codes = self._stop_all()
                return 0 if all(c in (0, None) for c in codes) else 1
            for child in self.children:
                proc = child.proc
                if proc is None or proc.poll() is None:
                    continue
                log.error("standalone: the %s (pid %d) exited with status %s", child.role, proc.pid, proc.returncode)
                if not self._restart(child):
                    self._stop_all()
                    return 1

    def _restart(self, child: Child) -> bool:
        """Start ``child`` again. A start that fails (the process dies or hangs before its ready
        line) counts as one more exit in the window and is tried again: the supervisor gives up
        when the window holds more than ``restarts_max`` exits, or after ``restarts_max`` failed
        starts in a row (starts that each outlast the window would otherwise go on for ever). A
        stop asked for meanwhile (SIGTERM, SIGINT) ends the attempts; ``_supervise`` then stops."""
        window_s = self.config.restart_window_ms / 1000
        for attempt in range(self.config.restarts_max + 1):
            now = time.monotonic()
            child.restarts = [t for t in child.restarts if now - t < window_s] + [now]
            if len(child.restarts) > self.config.restarts_max or attempt == self.config.restarts_max:
                log.error(
                    "standalone: the %s exited %d times within %.0f s (%d failed starts in a row); giving up:"
                    " its log above says why; mend that and start qmq standalone again (raise restarts_max"
                    " or restart_window_ms of [standalone] to allow more)",
                    child.role,
                    len(child.restarts),
                    window_s,
                    attempt,
                )
                return False
            if attempt and signal.sigpending() & _STOPS:
                return True  # the pending signal is taken by _supervise, which stops the rest
            try:
                child.start(now + self.config.ready_timeout_ms / 1000)
            except StartupFailed as exc:
                log.error("standalone: restarting the %s failed: %s", child.role, exc)
                continue
            log.warning("standalone: restarted the %s", child.role)
            return True
        return False

    def _stop_all(self) -> list[int | None]:
        # the gateway first (its consumer sends its last acks while the broker takes them), the
        # delay server next (it hands over what is due while the broker still takes it), then
        # the broker (it finishes writes and checkpoints), then the meta server
        return [child.stop() for child in reversed(self.children)]


def _run_demo(meta_url: str) -> None:
    from qmq.cli.demo import run_demo

    try:
        run_demo(meta_url)
    except Exception as exc:  # the demo is a courtesy; the servers keep running
        print(f"qmq demo failed: {exc}", file=sys.stderr, flush=True)
