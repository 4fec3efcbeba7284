"""qmq on Apache Spark: the ``qmq`` Python data source and the jobs behind ``qmq archive``,
``qmq query``, ``qmq trace`` and ``qmq report`` (docs/spark.md).

Needs the ``spark`` extra (``pip install 'qmq[spark]'``). Imports ``qmq.client`` and
``qmq.store.reader``; nothing else of qmq imports this package but the CLI.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from qmq.spark.datasource import QmqDataSource

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

__all__ = ["QmqDataSource", "register"]


def register(spark: SparkSession) -> None:
    """Make ``format("qmq")`` known to ``spark`` (reads, writes, streams)."""
    spark.dataSource.register(QmqDataSource)
