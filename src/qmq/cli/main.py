"""Entry point of the ``qmq`` command: one sub-command per role or task.

Exit status, the same for every command: 0 success; 1 a failure the command reports (a server
down or refusing, an unknown subject or group, a command whose extra is not installed); 2 a
usage error (an unknown option, a bad value); 3 a server that could not start (``qmq
standalone``, ``qmq cluster up``). A failure prints one line on stderr naming what went wrong,
never a traceback. ``pip install qmq`` is the client SDK alone: a command whose extra is
missing names the extra to install.
"""

from __future__ import annotations

import importlib.util
import logging
import logging.handlers
import os
import sys

import click

from qmq import __version__
from qmq.common.errors import ConfigError, InvalidMessageError, QmqError
from qmq.common.limits import MiB

EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_MISSING_EXTRA = EXIT_FAILURE
# A server's log file is bounded on disk: rotated at this size, this many old files kept.
LOG_FILE_BYTES_MAX = 64 * MiB
LOG_FILES_KEPT = 3


# The modules each extra of pyproject.toml brings that the commands import; one missing
# means the extra is not installed. The `cli` extra itself is checked by qmq.__main__.
EXTRA_MODULES: dict[str, tuple[str, ...]] = {
    "server": ("uvloop", "numpy", "prometheus_client", "sqlalchemy"),
    "tx": ("sqlalchemy",),
    "spark": ("pyspark", "pyarrow", "pandas"),
}
# The commands (by path below `qmq`) that need an extra beyond the cli one. The servers run
# in child processes, so their extra is checked before the command starts them.
COMMAND_EXTRAS: dict[str, str] = {
    "meta": "server",
    "broker": "server",
    "delay": "server",
    "gateway": "server",
    "standalone": "server",
    "cluster up": "server",
    "tx": "tx",
    "watchdog": "tx",
    "archive": "spark",
    "query": "spark",
    "trace": "spark",
    "report": "spark",
}
_HELP_OPTIONS = ("-h", "--help")


class CommandError(QmqError):
    """A failure a command reports in its own words: one line on stderr, exit status 1."""


class MissingExtraError(QmqError):
    """A command needs modules of an extra that is not installed."""

    def __init__(self, command: str, extra: str, module: str) -> None:
        super().__init__(
            f"`qmq {command}` needs the {extra} extra, which is not installed (no module {module!r}): "
            f"pip install 'qmq[{extra}]'"
        )


def missing_extra(command: str) -> MissingExtraError | None:
    """The error to report when ``command`` (a path below ``qmq``) lacks its extra, else None."""
    extra = COMMAND_EXTRAS.get(command)
    if extra is None:
        return None
    for module in EXTRA_MODULES[extra]:
        if importlib.util.find_spec(module) is None:
            return MissingExtraError(command, extra, module)
    return None


def exit_status(exc: QmqError) -> int:
    """2 for a value the user gave that qmq refuses (a subject, a setting: usage), 1 for the rest."""
    return EXIT_USAGE if isinstance(exc, ConfigError | InvalidMessageError) else EXIT_FAILURE


def _extra_of(module: str, command: str) -> str | None:
    top = module.partition(".")[0]
    extras = [extra for extra, modules in EXTRA_MODULES.items() if top in modules]
    if COMMAND_EXTRAS.get(command) in extras:
        return COMMAND_EXTRAS[command]
    return extras[0] if extras else None


def _command_path(ctx: click.Context, name: str) -> str:
    names = [name]
    while ctx.parent is not None:
        names.append(ctx.info_name or "")
        ctx = ctx.parent
    return " ".join(reversed(names))


def _asks_the_brokers(command: str, args: list[str]) -> bool:
    """`qmq trace --meta-server URL` alone asks the brokers over the network: no Spark needed."""
    given = {a.split("=", 1)[0] for a in args}
    return command == "trace" and "--meta-server" in given and not {"--data-dir", "--archive"} & given


class QmqGroup(click.Group):
    # `qmq cluster`, `qmq tx` ... are QmqGroups too, so `cluster up` is checked like `standalone`
    group_class = type

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        name, cmd, rest = super().resolve_command(ctx, args)
        # --help works without the extra; shell completion (resilient parsing) runs nothing
        if (
            cmd is not None
            and cmd.name
            and not ctx.resilient_parsing
            and not set(_HELP_OPTIONS) & set(rest)
            and not _asks_the_brokers(_command_path(ctx, cmd.name), rest)
        ):
            error = missing_extra(_command_path(ctx, cmd.name))
            if error is not None:
                raise error
        return name, cmd, rest

    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except MissingExtraError as exc:
            click.echo(f"qmq: error: {exc}", err=True)
            ctx.exit(EXIT_MISSING_EXTRA)
        except QmqError as exc:
            click.echo(f"qmq: error: {exc}", err=True)
            ctx.exit(exit_status(exc))
        except ModuleNotFoundError as exc:
            # a module imported on first use by a command the table does not name
            command = _command_path(ctx, ctx.invoked_subcommand or "")
            extra = _extra_of(exc.name or "", command)
            if extra is None:
                raise
            click.echo(f"qmq: error: {MissingExtraError(command, extra, exc.name or '')}", err=True)
            ctx.exit(EXIT_MISSING_EXTRA)


@click.group(cls=QmqGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="qmq")
@click.option(
    "--log-level",
    default=lambda: os.environ.get("QMQ_LOG_LEVEL", "INFO"),
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
    help="how much the servers log to stderr [default: INFO, or $QMQ_LOG_LEVEL]",
)
@click.option(
    "--log-file",
    envvar="QMQ_LOG_FILE",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help=f"log to this file instead of stderr, rotated at {LOG_FILE_BYTES_MAX // MiB} MiB with "
    f"{LOG_FILES_KEPT} old files kept (FILE.1 ...) [or $QMQ_LOG_FILE]",
)
@click.option(
    "--app-code",
    "cli_app_code",
    envvar="QMQ_APP_CODE",
    default=None,
    help="the app the client commands act as, on servers with an auth file [or $QMQ_APP_CODE]",
)
@click.option(
    "--secret",
    "cli_secret",
    envvar="QMQ_SECRET",
    default=None,
    help="the app's secret [or $QMQ_SECRET, which keeps it out of the process list]",
)
@click.option(
    "--tls-ca",
    "cli_tls_ca",
    envvar="QMQ_TLS_CA",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="the CA the client commands trust for https:// meta servers and their brokers [or $QMQ_TLS_CA; "
    "default: the system's CAs and $SSL_CERT_FILE]",
)
def cli(
    log_level: str, log_file: str | None, cli_app_code: str | None, cli_secret: str | None, cli_tls_ca: str | None
) -> None:
    """qmq: a message queue in the shape of Qunar's QMQ.

    Start everything on one machine with `qmq standalone`; it prints a `qmq ready` line with
    the meta_server URL every other command takes.
    """
    # the client commands and the SDK they use read the identity from the environment
    if cli_app_code:
        os.environ["QMQ_APP_CODE"] = cli_app_code
    if cli_secret:
        os.environ["QMQ_SECRET"] = cli_secret
    if cli_tls_ca:
        # every default TLS context of a client command (the SDK's for https:// meta servers, HTTP
        # requests, a Spark job's executors) reads $SSL_CERT_FILE
        os.environ["QMQ_TLS_CA"] = os.environ["SSL_CERT_FILE"] = os.path.abspath(cli_tls_ca)
    handler: logging.Handler = logging.StreamHandler(sys.stderr)
    if log_file:
        try:
            handler = logging.handlers.RotatingFileHandler(
                log_file, maxBytes=LOG_FILE_BYTES_MAX, backupCount=LOG_FILES_KEPT
            )
        except OSError as exc:
            raise click.BadParameter(
                f"cannot open {log_file!r} for logging: {exc}; pass a file in an existing, writable directory",
                param_hint="--log-file",
            ) from None
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        handlers=[handler],
        format="%(asctime)s %(levelname)s [%(process)d %(name)s] %(message)s",
    )


def register_commands() -> None:
    """Import every command module: each registers its commands on ``cli``."""
    from qmq.cli import (  # noqa: F401
        alarm_commands,
        auth_commands,
        client_commands,
        cluster_commands,
        control_commands,
        delay_commands,
        group_commands,
        limits_commands,
        listing_commands,
        operations_commands,
        push_commands,
        roles,
        spark_commands,
        subject_commands,
        top_commands,
        tx_commands,
    )


def main() -> None:
    register_commands()
    cli(prog_name="qmq")
