"""nats-server with JetStream file storage (the `periodic` guarantee: no fsync per message)."""

from __future__ import annotations

import os
import re
import shutil
from typing import Any

from bench.servers.base import ServerProcess, dpkg_version
from bench.settings import HOST, NATS_PORT


class NatsServer(ServerProcess):
    name = "nats"
    package = "nats-server"
    data_subdirs = ("js",)

    def missing(self) -> str | None:
        return None if shutil.which("nats-server") else "nats-server not installed (Debian package nats-server)"

    def durability(self) -> str:
        return (
            "JetStream file storage, 1 replica; PubAck once the write is handed to the OS "
            "(the 2.9 filestore fsyncs on an internal timer; sync_interval is configurable only from 2.10)"
        )

    def version(self) -> str | None:
        return dpkg_version(self.package)

    def delay_unsupported(self) -> str | None:
        version = self.version() or "?"
        major_minor = tuple(int(x) for x in re.findall(r"\d+", version)[:2])
        if major_minor >= (2, 12):
            return f"skipped: nats-server {version} has message scheduling, but the bench does not drive it yet"
        return f"skipped: nats-server {version} has no delayed/scheduled delivery (message scheduling arrived in 2.12)"

    def start(self) -> dict[str, Any]:
        self.ensure_port_free(NATS_PORT)
        self.fresh_dir()
        conf = os.path.join(self.dir, "nats.conf")
        with open(conf, "w") as f:
            f.write(
                f'listen: "{HOST}:{NATS_PORT}"\n'
                "server_name: qmqbench\n"
                # W11's 1 MiB bodies and their headers (and W7's backlog of many subjects).
                "max_payload: 8MB\n"
                "jetstream {\n"
                f'  store_dir: "{self.dir}/js"\n'
                "  max_memory_store: 1GB\n"
                "  max_file_store: 20GB\n"
                "}\n"
            )
        self.popen(["nats-server", "-c", conf, "-l", os.path.join(self.dir, "nats.log")])
        self.wait_port(NATS_PORT, 30.0)
        return {"host": HOST, "port": NATS_PORT}
