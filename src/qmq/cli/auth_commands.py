"""``qmq auth hash``: the ``secret_hash`` value of an app's secret, for the auth file.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import sys

import click

from qmq.cli.main import cli
from qmq.common.errors import ConfigError


@cli.group("auth")
def auth_group() -> None:
    """Secrets of the apps in an auth file (--auth-file)."""


@auth_group.command("hash")
@click.option(
    "--secret",
    default=None,
    help="The secret to hash. Without it, the secret is read from stdin (its first line), "
    "which keeps it out of the shell's history and the process list.",
)
def auth_hash(secret: str | None) -> None:
    """Print the secret_hash of a secret, alone on one line: put it in the app's table of the auth file."""
    from qmq.auth.secrets import hash_secret

    if secret is None:
        line = sys.stdin.readline(4096)
        secret = line.rstrip("\r\n")
        if not secret:
            raise ConfigError("no secret on stdin; pipe one in (echo -n s3cret | qmq auth hash) or pass --secret")
    click.echo(hash_secret(secret))
