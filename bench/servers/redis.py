"""redis-server with an append-only file fsynced every second (the `periodic` guarantee)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from typing import Any

from bench.servers.base import ServerProcess, StartError, dpkg_version
from bench.settings import HOST, REDIS_PORT


class RedisServer(ServerProcess):
    name = "redis"
    package = "redis-server"
    data_subdirs = ("data",)

    def missing(self) -> str | None:
        return None if shutil.which("redis-server") else "redis-server not installed (Debian package redis-server)"

    def durability(self) -> str:
        return 'appendonly yes, appendfsync everysec (reply before fsync; fsync about once a second); RDB off'

    def version(self) -> str | None:
        return dpkg_version(self.package)

    def start(self) -> dict[str, Any]:
        self.ensure_port_free(REDIS_PORT)
        self.fresh_dir()
        data = os.path.join(self.dir, "data")
        os.makedirs(data, exist_ok=self.keep_data)
        self.popen([
            "redis-server",
            "--bind", HOST,
            "--port", str(REDIS_PORT),
            "--protected-mode", "yes",
            "--dir", data,
            "--daemonize", "no",
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
            "--logfile", os.path.join(self.dir, "redis.log"),
        ])
        self.wait_port(REDIS_PORT, 30.0)
        # The port opens before the data is loaded; until then every command is answered
        # -LOADING (W10's restart on 40,000 streams): serving means a PING answered +PONG.
        self.wait_serving(120.0)
        return {"host": HOST, "port": REDIS_PORT}

    def wait_serving(self, limit_s: float) -> None:
        deadline = time.monotonic() + limit_s
        answer = b""
        while time.monotonic() < deadline:
            try:
                with socket.create_connection((HOST, REDIS_PORT), timeout=5.0) as sock:
                    sock.sendall(b"PING\r\n")
                    answer = sock.recv(256)
            except OSError as exc:
                answer = repr(exc).encode()
            if answer.startswith(b"+PONG"):
                return
            time.sleep(0.01)  # loading: no readiness signal to wait on but the answer itself
        raise StartError(
            f"{self.name}: no PONG within {limit_s:.0f} s (last answer {answer[:80]!r}); see {self.log_path}"
        )
