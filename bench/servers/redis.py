"""redis-server with an append-only file fsynced every second (the `periodic` guarantee)."""

from __future__ import annotations

import os
import shutil
from typing import Any

from bench.servers.base import ServerProcess, dpkg_version
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
        return {"host": HOST, "port": REDIS_PORT}
