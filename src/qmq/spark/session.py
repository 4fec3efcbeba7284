"""SparkSessions for qmq's jobs: ``local[*]`` by default, any cluster by its master URL.

A local session binds the driver to 127.0.0.1, turns the UI off and keeps Spark's own log
quiet, so a job run from the command line shows only its progress and its summary.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping

from pyspark.sql import SparkSession

import qmq.spark

DEFAULT_MASTER = "local[*]"

LOCAL_CONF: Mapping[str, str] = {
    "spark.driver.bindAddress": "127.0.0.1",
    "spark.driver.host": "127.0.0.1",
    "spark.ui.enabled": "false",
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
    "spark.sql.shuffle.partitions": "8",
}

# on a cluster: the UI stays (the cluster manager links to it); Spark's own console bar is
# off (the commands show theirs)
CLUSTER_CONF: Mapping[str, str] = {
    "spark.ui.showConsoleProgress": "false",
    "spark.sql.session.timeZone": "UTC",
}


def build_session(
    master: str = DEFAULT_MASTER, app_name: str = "qmq", conf: Mapping[str, str] | None = None
) -> SparkSession:
    """A session with the ``qmq`` data source registered; loopback-only when ``master`` is local."""
    local = master.startswith("local")
    if local:
        os.environ.setdefault("SPARK_LOCAL_IP", "127.0.0.1")
    os.environ.setdefault("PYSPARK_PYTHON", sys.executable)
    os.environ.setdefault("PYSPARK_DRIVER_PYTHON", sys.executable)
    builder = SparkSession.builder.master(master).appName(app_name)
    settings = dict(LOCAL_CONF) if local else dict(CLUSTER_CONF)
    settings.update(conf or {})
    for key, value in settings.items():
        builder = builder.config(key, value)
    spark = builder.getOrCreate()
    spark.sparkContext.setLogLevel("ERROR")
    # py4j logs every callback (a stream's micro-batches) at INFO: only its warnings show
    py4j_log = logging.getLogger("py4j")
    py4j_log.setLevel(max(py4j_log.getEffectiveLevel(), logging.WARNING))
    qmq.spark.register(spark)
    return spark
