"""Entry point of the ``qmq`` command: one sub-command per role or task.

Errors a user can cause (a bad option, a server that cannot start, a broker that refuses)
print one line naming the problem and exit non-zero, without a traceback.
"""

from __future__ import annotations

import logging
import os
import sys

import click

from qmq import __version__
from qmq.common.errors import QmqError

EXIT_USAGE = 2


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
def cli(log_level: str) -> None:
    """qmq: a message queue in the shape of Qunar's QMQ.

    Start everything on one machine with `qmq standalone`; it prints a `qmq ready` line with
    the meta_server URL every other command takes.
    """
    logging.basicConfig(
        level=getattr(logging, log_level.upper()),
        stream=sys.stderr,
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
