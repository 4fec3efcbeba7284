"""Running a server role as a process: uvloop, SIGTERM/SIGINT for an ordered shutdown, one
``qmq ready`` line on stdout once serving (flushed, also into a pipe), exit 0 after a clean
stop and 3 when the server cannot start (one line on stderr naming why, no traceback).
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import gc
import logging
import resource
import signal
import socket
import sys
from collections.abc import Callable
from ssl import SSLContext
from typing import Protocol

import uvloop
from aiohttp import web

from qmq.common.errors import QmqError

log = logging.getLogger(__name__)

EXIT_STARTUP_FAILED = 3
# The server stopped, but not cleanly: what it could not finish (its final checkpoint) is on stderr.
EXIT_STOP_FAILED = 4
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_MALLOC_THRESHOLD_BYTES = 256 * 1024
_GC_YOUNG_THRESHOLD = 20_000


class StartupError(Exception):
    """The server cannot start; the text says why and what to do."""


class RunnableServer(Protocol):
    async def start(self) -> None: ...

    async def wait_registered(self) -> None: ...

    def ready_line(self) -> str: ...

    async def stop(self) -> None: ...

    @property
    def stop_failed(self) -> str | None:
        """What the last ``stop`` could not finish, or None after a clean stop."""
        ...


def tune_gc() -> None:
    """Once a server has started: what start-up made lives as long as the process, so keep it out
    of the collector's full passes (which would pause the loop for longer as the heap grows); and
    since a burst of requests allocates many short-lived containers, collect the young generation
    every 20,000 of them rather than every 700 (CPython's default): fewer pauses under load."""
    gc.freeze()
    gc.set_threshold(_GC_YOUNG_THRESHOLD, 20, 50)


def run_server(role: str, make: Callable[[], RunnableServer]) -> int:
    """Run the server ``make()`` builds until SIGTERM or SIGINT (see the module docstring)."""
    return_freed_memory()
    raise_fd_limit()
    with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
        return runner.run(_serve(role, make))


async def _serve(role: str, make: Callable[[], RunnableServer]) -> int:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        server = make()
    except (QmqError, OSError) as exc:
        print(f"qmq {role}: cannot start: {exc}", file=sys.stderr, flush=True)
        return EXIT_STARTUP_FAILED
    try:
        await server.start()
    except (StartupError, QmqError, OSError) as exc:
        print(f"qmq {role}: cannot start: {exc}", file=sys.stderr, flush=True)
        await server.stop()
        return EXIT_STARTUP_FAILED
    tune_gc()
    try:
        registered = asyncio.ensure_future(server.wait_registered())
        stopped = asyncio.ensure_future(stop.wait())
        await asyncio.wait([registered, stopped], return_when=asyncio.FIRST_COMPLETED)
        registered.cancel()
        if not stop.is_set():
            print(server.ready_line(), flush=True)
            await stopped
        log.info("%s shutting down", role)
    finally:
        await server.stop()
    if server.stop_failed is not None:
        print(f"qmq {role}: stopped, but {server.stop_failed}", file=sys.stderr, flush=True)
        return EXIT_STOP_FAILED
    return 0


def return_freed_memory() -> None:
    """Have glibc give large freed blocks (frames, batch buffers) back to the system.

    By default glibc raises its mmap threshold after large blocks are freed, so later large
    blocks come from the heap and the resident size keeps the high-water mark of every burst.
    """
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _MALLOC_THRESHOLD_BYTES)
    except (OSError, AttributeError):  # not glibc: nothing to tune
        pass


def raise_fd_limit() -> None:
    # Consume logs, schedule logs and client connections are open files: use what the system allows.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def listen_error(what: str, host: str, port: int, exc: OSError, option: str) -> str:
    if exc.errno == errno.EADDRINUSE:
        return f"{what} port {port} on {host} is already in use; choose another with {option} (0 picks a free one)"
    if exc.errno == errno.EADDRNOTAVAIL:
        return f"cannot listen on {host}: it is not an address of this machine; use --host 127.0.0.1 or a local address"
    return f"cannot listen on {host}:{port}: {exc}"


async def serve_http(
    app: web.Application, host: str, port: int, what: str, option: str, ssl_context: SSLContext | None = None
) -> tuple[web.AppRunner, int]:
    """Serve ``app`` on host:port (0 picks a free port), over TLS with ``ssl_context``; returns the
    runner and the port bound."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        await runner.cleanup()
        raise StartupError(listen_error(what, host, port, exc, option)) from None
    bound = int(sock.getsockname()[1])
    await web.SockSite(runner, sock, ssl_context=ssl_context).start()
    return runner, bound
