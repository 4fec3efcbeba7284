"""Entry point of the ``qmq`` command: one sub-command per role or task.

Errors a user can cause (a bad option, a server that cannot start, a broker that refuses)
print one line naming the problem and exit non-zero, without a traceback.
"""

from __future__ import annotations

import logging
import logging.handlers
import os
import sys

import click

from qmq import __version__
from qmq.common.errors import QmqError
from qmq.common.limits import MiB

EXIT_USAGE = 2
# A server's log file is bounded on disk: rotated at this size, this many old files kept.
LOG_FILE_BYTES_MAX = 64 * MiB
LOG_FILES_KEPT = 3


class QmqGroup(click.Group):
    def invoke(self, ctx: click.Context) -> object:
        try:
            return super().invoke(ctx)
        except QmqError as exc:
            click.echo(f"qmq: error: {exc}", err=True)
            ctx.exit(EXIT_USAGE)


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
def cli(log_level: str, log_file: str | None) -> None:
    """qmq: a message queue in the shape of Qunar's QMQ.

    Start everything on one machine with `qmq standalone`; it prints a `qmq ready` line with
    the meta_server URL every other command takes.
    """
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


def main() -> None:
    # each module registers its commands
    from qmq.cli import (  # noqa: F401
        client_commands,
        cluster_commands,
        delay_commands,
        group_commands,
        roles,
        spark_commands,
        tx_commands,
    )

    cli(prog_name="qmq")
