"""Spark jobs for people: ``qmq archive``, ``qmq query``, ``qmq trace``, ``qmq report``.

Each starts a SparkSession (``--spark-master``, ``local[*]`` by default), shows a progress
bar of Spark's tasks on stderr and ends with a summary. PySpark comes with the ``spark``
extra and is imported only when one of these commands runs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from rich.console import Console
from rich.markup import escape
from rich.table import Table
from rich.text import Text

from qmq.cli.main import cli
from qmq.cli.output import echo_json, json_option, print_table, stdout_console

if TYPE_CHECKING:
    from pyspark.sql import SparkSession

_TEXT_CHARS_MAX = 60

spark_master_option = click.option(
    "--spark-master",
    default="local[*]",
    show_default=True,
    metavar="URL",
    help="Spark master: local[*] runs here; spark://host:7077, yarn, k8s://… run on a cluster",
)


def _conf_pair(_ctx: click.Context, _param: click.Parameter, values: tuple[str, ...]) -> dict[str, str]:
    out: dict[str, str] = {}
    for value in values:
        key, sep, text = value.partition("=")
        if not sep or not key.strip():
            raise click.BadParameter(f"{value!r} is not KEY=VALUE, e.g. spark.executor.memory=2g")
        out[key.strip()] = text
    return out


spark_conf_option = click.option(
    "--spark-conf",
    "spark_conf",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_conf_pair,
    help="a Spark setting for this job, as spark-submit's --conf (repeatable), e.g. spark.executor.memory=2g",
)


@contextmanager
def _session(master: str, app: str, conf: dict[str, str] | None = None) -> Iterator[SparkSession]:
    try:
        from qmq.spark.session import build_session
    except ImportError as exc:
        raise click.ClickException(
            f"qmq {app} runs on Spark, which is not installed ({exc}); install it with: pip install 'qmq[spark]'"
        ) from None
    console = Console(stderr=True)
    with console.status(f"starting Spark ({master})"):
        spark = build_session(master, app_name=f"qmq {app}", conf=conf)
    try:
        yield spark
    finally:
        spark.stop()


def _progress(spark: SparkSession, text: str) -> Any:
    from qmq.spark.progress import SparkProgress

    return SparkProgress(spark, text)


def _text(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, default=str) if value is not None else ""


def _short(value: object) -> str:
    text = _text(value)
    return text if len(text) <= _TEXT_CHARS_MAX else text[: _TEXT_CHARS_MAX - 1] + "…"


@cli.command()
@click.option("--meta-server", metavar="URL", help="read through the brokers of this meta server (`qmq ready` URL)")
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="read a broker's data directory offline instead (safe while the broker runs)",
)
@click.option("--broker-group", default=None, metavar="NAME", help="broker group named in rows read from --data-dir")
@click.option("--to", "to", required=True, type=click.Path(file_okay=False, path_type=Path), help="archive directory")
@click.option(
    "--follow",
    is_flag=True,
    help="keep archiving as messages arrive (a Spark stream, one commit per micro-batch) until Ctrl-C or SIGTERM",
)
@click.option(
    "--trigger-interval",
    default="10s",
    show_default=True,
    metavar="DURATION",
    help="with --follow: how often a micro-batch starts (10s, 500ms, 2m)",
)
@click.option(
    "--max-per-batch",
    default=1_000_000,
    show_default=True,
    type=click.IntRange(min=1),
    help="with --follow: most messages one micro-batch archives",
)
@spark_master_option
@spark_conf_option
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="print what was archived as one JSON document: {archive, messages, subjects, per_subject, "
    "dead_letters, groups, skipped, seconds}; with --follow, a JSON line per micro-batch: "
    "{batch, manifest, messages, subjects, per_subject, lag, groups, dead_letters, seconds}",
)
def archive(
    meta_server: str | None,
    data_dir: Path | None,
    broker_group: str | None,
    to: Path,
    follow: bool,
    trigger_interval: str,
    max_per_batch: int,
    spark_master: str,
    spark_conf: dict[str, str],
    as_json: bool,
) -> None:
    """Export stored messages to Parquet, partitioned by subject and date; a re-run adds only what is new.

    Also records each consumer group's lag and the new dead letters (for `qmq report`).
    With --follow it keeps the archive up to date as messages arrive, a line per micro-batch.
    """
    from qmq.spark.archive import run_archive, source_options

    source = source_options(meta_server, str(data_dir) if data_dir else None, broker_group)
    if follow:
        _follow(source, to, trigger_interval, max_per_batch, spark_master, spark_conf, as_json)
        return
    with _session(spark_master, "archive", spark_conf) as spark, _progress(spark, f"archiving into {to}") as bar:
        result = run_archive(spark, source, to, on_plan=lambda n: bar.describe(f"archiving {n:,} messages"))
    if as_json:
        echo_json(
            {
                "archive": str(to),
                "messages": result.messages,
                "subjects": result.subjects,
                "per_subject": dict(sorted(result.per_subject.items())),
                "dead_letters": result.dead_letters,
                "groups": result.groups,
                "skipped": result.skipped,
                "seconds": round(result.seconds, 3),
            }
        )
        return
    table = Table(title=f"archived into {to}")
    table.add_column("subject")
    table.add_column("messages", justify="right")
    for subject, n in sorted(result.per_subject.items()):
        table.add_row(Text(subject), f"{n:,}")
    console = stdout_console()
    if result.per_subject:
        print_table(console, table)
    rate = result.messages / result.seconds if result.seconds else 0.0
    console.print(
        f"{result.messages:,} messages of {result.subjects} subjects in {result.seconds:.1f} s ({rate:,.0f}/s); "
        f"{result.dead_letters} new dead letters; lag of {result.groups} consumer groups"
        + (f"; {result.skipped:,} messages were removed by retention before being archived" if result.skipped else "")
    )


def _follow(
    source: dict[str, str],
    to: Path,
    trigger_interval: str,
    max_per_batch: int,
    spark_master: str,
    spark_conf: dict[str, str],
    as_json: bool,
) -> None:
    """``qmq archive --follow``: runs until SIGINT or SIGTERM, then exits 0 after the micro-batch under way."""
    import signal
    import threading

    from qmq.spark.follow import BatchReport, Follower, parse_interval

    interval_s = parse_interval(trigger_interval)
    err = Console(stderr=True, soft_wrap=True, highlight=False)
    out = stdout_console()

    def line(report: BatchReport) -> None:
        if as_json:
            echo_json(
                {
                    "batch": report.batch,
                    "manifest": report.manifest,
                    "messages": report.messages,
                    "subjects": report.subjects,
                    "per_subject": dict(sorted(report.per_subject.items())),
                    "lag": report.lag,
                    "groups": report.groups,
                    "dead_letters": report.dead_letters,
                    "seconds": report.seconds,
                }
            )
            return
        extra = ""
        if report.groups or report.dead_letters:
            extra = f"; lag of {report.groups} consumer groups, {report.dead_letters} new dead letters"
        out.print(
            f"batch {report.batch}: {report.messages:,} messages of {report.subjects} subject(s) "
            f"in {report.seconds:.1f} s; {report.lag:,} behind the brokers{extra}",
            markup=False,
            highlight=False,
        )

    stop = threading.Event()

    def on_signal(signum: int, _frame: object) -> None:
        if not stop.is_set():
            err.print(f"{signal.Signals(signum).name}: stopping after the micro-batch under way", markup=False)
        stop.set()

    # before Spark starts (a signal while it starts stops the run before its first micro-batch),
    # and SIGINT again after: PySpark's SparkContext puts its own (cancel every job) in place
    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        with _session(spark_master, "archive --follow", spark_conf) as spark:
            signal.signal(signal.SIGINT, on_signal)
            follower = Follower(
                spark,
                source,
                to,
                trigger_interval_s=interval_s,
                max_per_batch=max_per_batch,
                on_batch=line,
                stop=stop,
            )
            err.print(
                f"archiving into {to} as messages arrive, a micro-batch every {interval_s:g} s; "
                "Ctrl-C or SIGTERM stops it",
                markup=False,
            )
            result = follower.run()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    err.print(
        f"stopped: {result.messages:,} messages of {len(result.per_subject)} subjects "
        f"in {result.batches} micro-batches",
        markup=False,
    )


def _prop(value: str) -> tuple[str, str]:
    key, sep, text = value.partition("=")
    if not sep or not key:
        raise click.BadParameter(f"{value!r} is not k=v", param_hint="--property")
    return key, text


_archive_option = click.option(
    "--archive",
    "archive_dir",
    required=True,
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="the --to of `qmq archive`",
)

_QUERY_COLUMNS = ("subject", "sequence", "message_id", "created_at", "stored_at", "tags", "properties", "body")


@cli.command()
@_archive_option
@click.option("--message-id", metavar="ID", help="find one message by id (its time prunes the dates read)")
@click.option("--subject", metavar="SUBJECT", help="messages of this subject")
@click.option("--since", metavar="TIME", help="created at or after this ISO 8601 time (UTC without an offset)")
@click.option("--until", metavar="TIME", help="created before this ISO 8601 time")
@click.option("--property", "props", multiple=True, metavar="K=V", help="property K has value V (repeatable)")
@click.option("--limit", default=100, show_default=True, help="most messages to show (with --subject)")
@json_option("lines", "each message found: {" + ", ".join(_QUERY_COLUMNS) + "}")
@spark_master_option
@spark_conf_option
def query(
    archive_dir: Path,
    message_id: str | None,
    subject: str | None,
    since: str | None,
    until: str | None,
    props: tuple[str, ...],
    limit: int,
    as_json: bool,
    spark_master: str,
    spark_conf: dict[str, str],
) -> None:
    """Find messages in an archive: by --message-id, or by --subject with times and properties."""
    from qmq.spark.query import SubjectQuery, body_text, find_by_id, find_by_subject, json_ready

    if (message_id is None) == (subject is None):
        raise click.UsageError("give --message-id or --subject")
    if message_id is not None and (since or until or props):
        raise click.UsageError("--since, --until and --property go with --subject")
    pairs = tuple(_prop(p) for p in props)
    with _session(spark_master, "query", spark_conf) as spark:
        t0 = time.monotonic()
        with _progress(spark, "searching the archive"):
            if message_id is not None:
                rows = find_by_id(spark, archive_dir, message_id)
            else:
                assert subject is not None
                rows = find_by_subject(spark, archive_dir, SubjectQuery(subject, since, until, pairs, limit))
        seconds = time.monotonic() - t0
    if as_json:
        for row in json_ready(rows):
            click.echo(json.dumps(row, ensure_ascii=False))
        return
    console = stdout_console()
    # on a terminal long values are cut to fit; piped, every value is whole
    shown = _short if console.is_terminal else _text
    table = Table()
    for col in _QUERY_COLUMNS:
        table.add_column(col, overflow="fold")
    for row in rows:
        table.add_row(*(Text(shown(body_text(row[c]) if c == "body" else row.get(c))) for c in _QUERY_COLUMNS))
    print_table(console, table)
    console.print(f"{len(rows)} message(s) in {seconds:.2f} s")


@cli.command()
@click.argument("message_id")
@click.option(
    "--data-dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="the broker's data directory: needed for who pulled and acked (the action log)",
)
@click.option(
    "--archive",
    "archive_dir",
    type=click.Path(exists=True, file_okay=False, path_type=Path),
    help="an archive (`qmq archive --to`) to search too, for messages retention removed",
)
@click.option(
    "--meta-server",
    metavar="URL",
    help="alone: every broker group tells what its files hold of the message (no data directory, no Spark)",
)
@click.option("--broker-group", default="broker-1", show_default=True, help="the broker group of --data-dir")
@json_option("document", "the trace: {message_id, stored, deliveries, dead, notes}")
@spark_master_option
@spark_conf_option
def trace(
    message_id: str,
    data_dir: Path | None,
    archive_dir: Path | None,
    meta_server: str | None,
    broker_group: str,
    as_json: bool,
    spark_master: str,
    spark_conf: dict[str, str],
) -> None:
    """The life of MESSAGE_ID: stored, pulled by which consumer of which group, acked or retried
    (attempts, errors), dead-lettered.

    With only --meta-server each broker group is asked over the network (its files, read by the
    broker: stored, pulled by whom, acked, retried, dead-lettered); with --data-dir or --archive
    a Spark job reads the files.
    """
    if meta_server is not None and data_dir is None and archive_dir is None:
        from qmq.cli.trace_network import print_network_trace

        print_network_trace(meta_server, message_id, as_json)
        return
    from qmq.spark.trace import trace as run_trace

    with _session(spark_master, "trace", spark_conf) as spark, _progress(spark, f"tracing {message_id}"):
        result = run_trace(
            spark,
            message_id,
            data_dir=str(data_dir) if data_dir else None,
            archive=archive_dir,
            meta_server=meta_server,
            broker_group=broker_group,
        )
    if as_json:
        click.echo(result.to_json())
        return
    console = stdout_console()
    shown = _short if console.is_terminal else _text
    console.print(f"[bold]message {escape(message_id)}[/bold]")
    for s in result.stored:
        attempt = "" if s.attempt is None else f" attempt {s.attempt}"
        error = f" error: {shown(s.error)}" if s.error else ""
        console.print(
            f"  stored    {s.stored_at}  {s.subject} #{s.sequence} ({s.broker_group}, {s.found_in}){attempt}{error}",
            markup=False,
        )
        for d in result.deliveries:
            if d.subject == s.subject:
                who = f"consumer {d.consumer_id}" if d.consumer_id else "a consumer"
                state = "acked" if d.acked else "not acked"
                at = f" at pull-log offset {d.pull_log_offset}" if d.pull_log_offset is not None else ""
                console.print(
                    f"    pulled by {who} of group {d.consumer_group}{at}: {state} ({d.known_from})", markup=False
                )
    for letter in result.dead:
        state = " (since resent or purged)" if letter.removed else ""
        console.print(
            f"  dead      {letter.dead_at}  group {letter.consumer_group} after {letter.attempts} attempts"
            f"{': ' + shown(letter.error) if letter.error else ''}{state}",
            markup=False,
        )
    for note in result.notes:
        console.print(f"  note: {note}", markup=False)


@cli.command()
@_archive_option
@click.option(
    "--out", type=click.Path(file_okay=False, path_type=Path), help="where to write [default: ARCHIVE/_report]"
)
@spark_master_option
@spark_conf_option
@json_option("document", "{written_to, rows: [{subject, date, messages, bytes, retries, retry_rate, ...}]}")
def report(archive_dir: Path, out: Path | None, spark_master: str, spark_conf: dict[str, str], as_json: bool) -> None:
    """Per subject and day: messages, bytes, retry and dead-letter rates, consumer lag (Parquet and a table)."""
    from qmq.spark.report import COLUMNS, run_report

    with _session(spark_master, "report", spark_conf) as spark, _progress(spark, "building the report"):
        target, rows = run_report(spark, archive_dir, out)
    if as_json:
        echo_json({"written_to": str(target), "rows": rows})
        return
    table = Table(title=f"qmq report of {archive_dir}")
    for col in COLUMNS:
        table.add_column(col, justify="left" if col in ("subject", "date") else "right", overflow="fold")
    for row in rows:
        cells = []
        for col in COLUMNS:
            value = row[col]
            if value is None:
                cells.append("-")
            elif col.endswith("_rate"):
                cells.append(f"{value:.2%}")
            elif isinstance(value, int):
                cells.append(f"{value:,}")
            else:
                cells.append(str(value))
        table.add_row(*(Text(cell) for cell in cells))
    console = stdout_console()
    print_table(console, table)
    console.print(f"{len(rows)} row(s) written to {escape(str(target))}")
