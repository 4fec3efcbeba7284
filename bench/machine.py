"""What a figure was measured on: the machine and the version of every server and client."""

from __future__ import annotations

import os
import platform
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from bench.servers.base import dpkg_version

DEBIAN_PACKAGES = ("rabbitmq-server", "erlang-base", "nats-server", "redis-server")
PYPI_PACKAGES = ("qmq", "pika", "nats-py", "redis", "hiredis", "uvloop")


def _cpu_model() -> str | None:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _mem_total_mib() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        return None
    return None


def _os_release() -> str | None:
    try:
        with open("/etc/os-release") as f:
            for line in f:
                if line.startswith("PRETTY_NAME="):
                    return line.split("=", 1)[1].strip().strip('"')
    except OSError:
        return None
    return None


def machine() -> dict[str, Any]:
    return {
        "cpu_model": _cpu_model(),
        "cores": os.cpu_count(),
        "cores_usable": len(os.sched_getaffinity(0)),
        "memory_mib": _mem_total_mib(),
        "kernel": platform.release(),
        "os": _os_release(),
        "python": platform.python_version(),
        "load_avg_at_start": [round(x, 2) for x in os.getloadavg()],
    }


def versions() -> dict[str, Any]:
    pypi: dict[str, str | None] = {}
    for name in PYPI_PACKAGES:
        try:
            pypi[name] = version(name)
        except PackageNotFoundError:
            pypi[name] = None
    return {"debian": {name: dpkg_version(name) for name in DEBIAN_PACKAGES}, "pypi": pypi}
