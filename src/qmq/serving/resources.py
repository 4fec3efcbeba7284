"""What a server uses of its machine, in its /metrics: the process's CPU, memory and open files
(``qmq_process_*``, read from /proc by prometheus_client at each scrape) and the disk that holds
its data directory (``qmq_disk_*``, one statvfs a scrape). ``qmq top`` shows them per server."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path

from prometheus_client import CollectorRegistry, ProcessCollector
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector


class _DiskCollector(Collector):
    def __init__(self, data_dir: Path) -> None:
        self._data_dir = data_dir

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            usage = shutil.disk_usage(self._data_dir)
        except OSError:  # the directory is gone or unreadable: say nothing rather than fail the scrape
            return
        yield GaugeMetricFamily(
            "qmq_disk_free_bytes", "bytes free to this server on the disk of its data directory", value=usage.free
        )
        yield GaugeMetricFamily("qmq_disk_total_bytes", "size of the disk of the data directory", value=usage.total)


def register_resources(registry: CollectorRegistry, data_dir: Path) -> None:
    """Add the process and disk metrics to ``registry``."""
    ProcessCollector(namespace="qmq", registry=registry)
    registry.register(_DiskCollector(data_dir))
