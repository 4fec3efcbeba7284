"""rabbitmq-server on loopback with its own epmd, node name, ports and config files, so
it never meets the system's RabbitMQ service (the `sync` guarantee with quorum queues)."""

from __future__ import annotations

import glob
import os
import subprocess
import time
from typing import IO, Any

from bench.procfs import port_open, stop_pid
from bench.servers.base import ServerProcess, dpkg_version
from bench.settings import HOST, RABBITMQ_DIST_PORT, RABBITMQ_EPMD_PORT, RABBITMQ_PORT

RABBITMQ_SERVER = "/usr/lib/rabbitmq/bin/rabbitmq-server"


class RabbitMqServer(ServerProcess):
    name = "rabbitmq"
    package = "rabbitmq-server"
    data_subdirs = ("mnesia", "home")

    def __init__(self, data_root: str, settings: Any) -> None:
        super().__init__(data_root, settings)
        self.epmd: subprocess.Popen[bytes] | None = None
        self._epmd_log: IO[bytes] | None = None
        self.node = "qmqbench@localhost"
        self.port, self.dist_port, self.epmd_port = RABBITMQ_PORT, RABBITMQ_DIST_PORT, RABBITMQ_EPMD_PORT
        # a TLS listener beside the plain one (bench/secure_throughput.py): its port, and the
        # certificate, key and CA files (PEM) it is configured with
        self.tls_port: int | None = None
        self.tls_files: dict[str, str] = {}

    def missing(self) -> str | None:
        if not os.path.exists(RABBITMQ_SERVER):
            return f"{RABBITMQ_SERVER} not installed (Debian package rabbitmq-server)"
        return None

    def durability(self) -> str:
        return (
            f"durable {self.settings.rabbitmq_queue_type} queue, persistent messages, publisher confirms "
            "(a confirm is sent once the message is written and fsynced)"
        )

    def version(self) -> str | None:
        return dpkg_version(self.package)

    def delay_unsupported(self) -> str | None:
        plugins = glob.glob("/usr/lib/rabbitmq/lib/*/plugins/rabbitmq_delayed_message_exchange*")
        if plugins:
            return "skipped: the delayed-message exchange plugin exists here but the bench does not enable it yet"
        return (
            "skipped: no native delayed delivery; the rabbitmq_delayed_message_exchange plugin is not "
            "packaged for Debian 12 (not in `apt-cache search rabbitmq`, not in "
            "/usr/lib/rabbitmq/lib/*/plugins) and cannot be downloaded here"
        )

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update({
            "HOME": os.path.join(self.dir, "home"),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": HOST,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": os.path.join(self.dir, "mnesia"),
            "RABBITMQ_LOG_BASE": os.path.join(self.dir, "log"),
            "RABBITMQ_CONFIG_FILE": os.path.join(self.dir, "rabbitmq.conf"),
            "RABBITMQ_ADVANCED_CONFIG_FILE": os.path.join(self.dir, "advanced.config"),
            "RABBITMQ_CONF_ENV_FILE": os.path.join(self.dir, "rabbitmq-env.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": os.path.join(self.dir, "enabled_plugins"),
            "RABBITMQ_PID_FILE": os.path.join(self.dir, "rabbit.pid"),
            "RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": "-kernel inet_dist_use_interface {127,0,0,1}",
            "ERL_EPMD_ADDRESS": HOST,
            "ERL_EPMD_PORT": str(self.epmd_port),
        })
        return env

    def _write_config(self) -> None:
        conf = f"listeners.tcp.1 = {HOST}:{self.port}\nlog.console = false\nlog.file.level = warning\n"
        if self.tls_port is not None:
            # TLS without client certificates, as qmq's secure bench runs (clients prove who they
            # are with a password here, a secret there)
            conf += (
                f"listeners.ssl.1 = {HOST}:{self.tls_port}\n"
                f"ssl_options.cacertfile = {self.tls_files['ca']}\n"
                f"ssl_options.certfile = {self.tls_files['cert']}\n"
                f"ssl_options.keyfile = {self.tls_files['key']}\n"
                "ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n"
            )
        files = {
            "rabbitmq.conf": conf,
            "advanced.config": "[].\n",
            "rabbitmq-env.conf": "",
            "enabled_plugins": "[].\n",
        }
        for name, text in files.items():
            with open(os.path.join(self.dir, name), "w") as f:
                f.write(text)

    def start(self) -> dict[str, Any]:
        for port in (self.port, self.dist_port, self.epmd_port, *([self.tls_port] if self.tls_port else [])):
            self.ensure_port_free(port)
        self.fresh_dir()
        os.makedirs(os.path.join(self.dir, "home"), exist_ok=self.keep_data)
        self._write_config()
        env = self._env()
        # Our own epmd, in the foreground so we hold its PID and can stop it.
        self._epmd_log = open(os.path.join(self.dir, "epmd.log"), "ab")  # noqa: SIM115 - closed in stop()
        self.epmd = subprocess.Popen(
            ["epmd", "-address", HOST, "-port", str(self.epmd_port)],
            stdout=self._epmd_log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 10.0
        while not port_open(self.epmd_port) and time.monotonic() < deadline:
            time.sleep(0.1)
        self.popen([RABBITMQ_SERVER], env=env)
        self.wait_port(self.port, 90.0)
        if self.tls_port is not None:
            self.wait_port(self.tls_port, 30.0)
        return {"host": HOST, "port": self.port}

    def extra_pids(self) -> list[int]:
        return [self.epmd.pid] if self.epmd is not None else []

    def stop(self) -> None:
        super().stop()
        if self.epmd is not None:
            stop_pid(self.epmd.pid, 10.0)
            self.epmd = None
        if self._epmd_log is not None:
            self._epmd_log.close()
            self._epmd_log = None
