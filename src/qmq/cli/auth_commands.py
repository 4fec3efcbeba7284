"""``qmq auth hash``: the ``secret_hash`` value of an app's secret, for the auth file.

Registered on the ``qmq`` group when imported (``qmq.cli.main.main`` imports it).
"""

from __future__ import annotations

import os
import ssl
import sys
from contextvars import ContextVar
from typing import TYPE_CHECKING

import click

from qmq.cli.main import cli
from qmq.common.errors import ConfigError

if TYPE_CHECKING:
    from qmq.auth.handshake import ClientCredentials


# (app code, secret) of the person a console request acts for (qmq.console): set for the
# request only, it takes the place of --app-code/--secret, so the console runs the commands'
# own calls as that person with that person's permissions.
ACTING_FOR: ContextVar[tuple[str, str] | None] = ContextVar("qmq_acting_for", default=None)


def cli_app_code(default: str) -> str:
    """The app a client command acts as: ``qmq --app-code`` or $QMQ_APP_CODE, else ``default``."""
    acting = ACTING_FOR.get()
    if acting is not None:
        return acting[0]
    return os.environ.get("QMQ_APP_CODE") or default


def _cli_secret() -> str:
    acting = ACTING_FOR.get()
    if acting is not None:
        return acting[1]
    return os.environ.get("QMQ_SECRET", "")


def cli_credentials(default_app: str = "qmq-cli") -> ClientCredentials | None:
    """What a client command's broker connections authenticate with, or None without a secret."""
    secret = _cli_secret()
    if not secret:
        return None
    from qmq.auth.handshake import ClientCredentials

    return ClientCredentials(cli_app_code(default_app), secret)


def cli_tls(meta_server: str) -> ssl.SSLContext | None:
    """The TLS context of a client command's broker connections: for an ``https://`` meta server,
    one trusting ``qmq --tls-ca`` ($QMQ_TLS_CA), else the system's CAs and $SSL_CERT_FILE; None
    (plaintext) for ``http://``."""
    if not meta_server.startswith("https://"):
        return None
    ca = os.environ.get("QMQ_TLS_CA") or None
    return ssl.create_default_context(cafile=ca)


def cli_authorization(default_app: str = "qmq-cli") -> str | None:
    """The Authorization header of a client command's meta server requests, or None without a secret."""
    secret = _cli_secret()
    if not secret:
        return None
    from qmq.auth.http import basic_authorization

    return basic_authorization(cli_app_code(default_app), secret)


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
