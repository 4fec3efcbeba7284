"""A progress bar for a Spark job, fed by Spark's status tracker (tasks done of tasks known).

A daemon thread polls the tracker a few times a second while the ``with`` block runs; the
bar counts the tasks of the stages that ran so far, so it moves as stages come and go.
"""

from __future__ import annotations

import threading
from types import TracebackType

from pyspark.sql import SparkSession
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

_POLL_S = 0.25
_STOP_WAIT_S = 5.0


class SparkProgress:
    """``with SparkProgress(spark, "archiving"):`` shows Spark's tasks as they finish."""

    def __init__(self, spark: SparkSession, description: str, console: Console | None = None) -> None:
        self._tracker = spark.sparkContext.statusTracker()
        self._progress = Progress(
            SpinnerColumn(),
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("tasks"),
            TimeElapsedColumn(),
            console=console or Console(stderr=True),
            transient=True,
        )
        self._task = self._progress.add_task(description, total=None)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, name="qmq-spark-progress", daemon=True)
        # stage id -> (tasks, completed): stages keep their last counts after they finish
        self._stages: dict[int, tuple[int, int]] = {}

    def describe(self, text: str) -> None:
        self._progress.update(self._task, description=text)

    def _poll(self) -> None:
        while not self._stop.wait(_POLL_S):  # bounded by the with block
            try:
                for stage_id in self._tracker.getActiveStageIds():
                    info = self._tracker.getStageInfo(stage_id)
                    if info is not None:
                        self._stages[stage_id] = (info.numTasks, info.numCompletedTasks)
            except Exception:  # the session is stopping: the bar just stops moving
                return
            total = sum(t for t, _ in self._stages.values())
            done = sum(c for _, c in self._stages.values())
            if total:
                self._progress.update(self._task, total=total, completed=done)

    def __enter__(self) -> SparkProgress:
        self._progress.start()
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join(_STOP_WAIT_S)
        self._progress.stop()
