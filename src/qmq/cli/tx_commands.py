"""``qmq tx init|unblock`` and ``qmq watchdog``: the outbox tables and the process that resends their rows.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import contextlib
import logging
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from types import FrameType
from typing import TYPE_CHECKING

import click

from qmq.cli.client_commands import meta_server_url
from qmq.cli.main import cli
from qmq.common.errors import ConfigError

if TYPE_CHECKING:
    import sqlalchemy as sa

    from qmq.tx.producer import SendsAsync
    from qmq.tx.watchdog import Watchdog

# The defaults of qmq.tx.schema, repeated so that `qmq` starts without importing SQLAlchemy
# (a test checks they agree).
DEFAULT_OUTBOX_TABLE = "qmq_msg_queue"
DEFAULT_LEASE_TABLE = "qmq_watchdog_lease"

log = logging.getLogger(__name__)

_db_option = click.option(
    "--db",
    "db_urls",
    multiple=True,
    required=True,
    metavar="URL",
    help="SQLAlchemy URL of an application database holding an outbox table (repeatable), "
    "e.g. postgresql+psycopg://user@host/db, mysql+pymysql://user@host/db, sqlite:///app.db",
)
_table_option = click.option(
    "--table", default=DEFAULT_OUTBOX_TABLE, show_default=True, help="name of the outbox table"
)
_lease_table_option = click.option(
    "--lease-table", default=DEFAULT_LEASE_TABLE, show_default=True, help="name of the watchdog lease table"
)


def _engines(urls: Sequence[str]) -> list[sa.Engine]:
    import sqlalchemy as sa

    engines = []
    for url in urls:
        try:
            engines.append(sa.create_engine(url, pool_pre_ping=True))
        except (sa.exc.ArgumentError, sa.exc.NoSuchModuleError, ImportError) as exc:
            raise ConfigError(f"--db {url!r} is not a usable SQLAlchemy database URL: {exc}") from None
    return engines


def _dispose(engines: Sequence[sa.Engine]) -> None:
    for engine in engines:
        engine.dispose()


@contextlib.contextmanager
def _database_errors() -> Iterator[None]:
    """A database error becomes one line naming it, not a traceback."""
    import sqlalchemy as sa

    try:
        yield
    except sa.exc.SQLAlchemyError as exc:
        first_line = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise click.ClickException(
            f"the database refused: {first_line} (are the tables there? `qmq tx init --db URL` creates them)"
        ) from None


@cli.group("tx")
def tx_group() -> None:
    """Transactional sends: the outbox table applications write messages into."""


@tx_group.command("init")
@_db_option
@_table_option
@_lease_table_option
def init(db_urls: tuple[str, ...], table: str, lease_table: str) -> None:
    """Create the outbox table and the watchdog lease table in each database (when absent)."""
    from qmq.tx.schema import create_outbox_tables

    engines = _engines(db_urls)
    try:
        with _database_errors():
            for engine in engines:
                create_outbox_tables(engine, table, lease_table)
                click.echo(f"qmq tx init: {engine.url.render_as_string()} has tables {table} and {lease_table}")
    finally:
        _dispose(engines)


@tx_group.command("unblock")
@_db_option
@_table_option
@click.option("--id", "ids", multiple=True, type=int, metavar="N", help="only this row id (repeatable); default all")
def unblock_command(db_urls: tuple[str, ...], table: str, ids: tuple[int, ...]) -> None:
    """Make blocked outbox rows pending again, with their attempts reset (after fixing the cause)."""
    from qmq.tx.watchdog import unblock

    engines = _engines(db_urls)
    try:
        with _database_errors():
            changed = unblock(engines, table, list(ids) if ids else None)
    finally:
        _dispose(engines)
    click.echo(f"qmq tx unblock: {changed} row(s) pending again")


@cli.command("watchdog")
@_db_option
@click.option(
    "--meta-server",
    envvar="QMQ_META_SERVER",
    metavar="URL",
    callback=meta_server_url,
    help="the meta_server URL printed by `qmq ready`, or its base URL http://HOST:PORT (or set QMQ_META_SERVER); "
    "not needed with --list-blocked",
)
@_table_option
@_lease_table_option
@click.option(
    "--threshold-ms",
    default=60_000,
    show_default=True,
    help="resend rows older than this (keep it well below the broker's dedup_window_ms)",
)
@click.option("--max-attempts", default=10, show_default=True, help="a row failing this many times is blocked")
@click.option("--batch-rows", default=100, show_default=True, help="rows claimed and sent together")
@click.option("--interval-ms", default=1_000, show_default=True, help="time between passes")
@click.option("--lease-ms", default=60_000, show_default=True, help="how long a watchdog's lease lasts unrenewed")
@click.option("--send-wait-ms", default=30_000, show_default=True, help="how long a batch waits for the broker")
@click.option("--once", is_flag=True, help="make one pass over the databases and exit")
@click.option("--list-blocked", is_flag=True, help="print the blocked rows and exit")
def watchdog_command(
    db_urls: tuple[str, ...],
    meta_server: str | None,
    table: str,
    lease_table: str,
    threshold_ms: int,
    max_attempts: int,
    batch_rows: int,
    interval_ms: int,
    lease_ms: int,
    send_wait_ms: int,
    once: bool,
    list_blocked: bool,
) -> None:
    """Resend outbox rows an application committed but never got sent (it crashed, the broker was down).

    Several watchdogs may run: a lease lets one at a time resend per database, and a row
    is claimed before it is sent, so no row is sent twice at once. SIGTERM or Ctrl-C
    stops it after the current pass.
    """
    engines = _engines(db_urls)
    try:
        if list_blocked:
            with _database_errors():
                _print_blocked(engines, table)
            return
        if not meta_server:
            raise click.UsageError("--meta-server is required (or set QMQ_META_SERVER), except with --list-blocked")
        from qmq.tx.watchdog import Watchdog

        def make(producer: SendsAsync) -> Watchdog:
            return Watchdog(
                producer,
                engines,
                table=table,
                lease_table_name=lease_table,
                threshold_ms=threshold_ms,
                max_attempts=max_attempts,
                batch_rows=batch_rows,
                interval_ms=interval_ms,
                lease_ms=lease_ms,
                send_wait_ms=send_wait_ms,
            )

        _run_watchdog(meta_server, once, len(engines), make)
    finally:
        _dispose(engines)


def _run_watchdog(meta_server: str, once: bool, databases: int, make: Callable[[SendsAsync], Watchdog]) -> None:
    from qmq.cli.auth_commands import cli_app_code
    from qmq.client.sync import Producer

    # the app of `qmq --app-code` ($QMQ_APP_CODE) with $QMQ_SECRET, on servers with an auth file;
    # a row it sends may have been stored by the first send: only to the group that would have
    with Producer(app_code=cli_app_code("qmq-watchdog"), meta_server=meta_server, resends=True) as producer:
        dog = make(producer)
        try:
            if once:
                reports = dog.run_once()
                for r in reports:
                    state = "leased" if r.leased else "not leased (another watchdog holds it)"
                    error = f" error: {r.error}" if r.error else ""
                    click.echo(
                        f"qmq watchdog: {r.database} {state}: resent {r.sent}, failed {r.failed}, "
                        f"blocked {r.blocked}{error}"
                    )
                if any(r.error for r in reports):
                    sys.exit(1)
                return
            stop = threading.Event()

            def on_signal(signum: int, frame: FrameType | None) -> None:
                stop.set()

            signal.signal(signal.SIGTERM, on_signal)
            signal.signal(signal.SIGINT, on_signal)
            click.echo(f"qmq watchdog ready owner={dog.owner} databases={databases}", err=True)
            dog.run(stop)
        finally:
            dog.close()


def _print_blocked(engines: list[sa.Engine], table: str) -> None:
    from rich.table import Table
    from rich.text import Text

    from qmq.cli.output import print_table, stdout_console
    from qmq.tx.watchdog import list_blocked

    rows = list_blocked(engines, table)
    console = stdout_console()
    if not rows:
        click.echo(f"no blocked rows in {table}")
        return
    out = Table(title=f"blocked rows of {table}")
    for name in ("database", "id", "message id", "subject", "attempts", "created (UTC)", "last error"):
        out.add_column(name, overflow="fold")
    for database, row in rows:
        out.add_row(
            *(
                Text(value)
                for value in (
                    database,
                    str(row.id),
                    row.message_id,
                    row.subject,
                    str(row.attempts),
                    row.created_at.strftime("%Y-%m-%d %H:%M:%S"),
                    row.last_error or "",
                )
            )
        )
    print_table(console, out)
    click.echo(f"{len(rows)} blocked row(s); after fixing the cause: qmq tx unblock --db URL [--id N]")
