"""How a Spark job reaches a cluster with an auth file and TLS: the app it acts as, its secret
and the CA it trusts, from the job's options with the ``qmq`` command's environment as the
fallback (``$QMQ_APP_CODE``, ``$QMQ_SECRET``; an ``https://`` meta server URL without
``tls_ca`` uses the system's trust and ``$SSL_CERT_FILE``).

An ``Access`` is small and picklable: a read task carries it to an executor, which may be on
another machine, so the executor opens its connections with the same identity and trust.
"""

from __future__ import annotations

import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from qmq.common.errors import ConfigError

if TYPE_CHECKING:
    from qmq.auth.handshake import ClientCredentials

APP_CODE_ENV = "QMQ_APP_CODE"
SECRET_ENV = "QMQ_SECRET"
TLS_CA_ENV = "QMQ_TLS_CA"
DEFAULT_APP_CODE = "qmq-spark"


@dataclass(frozen=True, slots=True)
class Access:
    """The app, secret ("" for none) and CA file (None: the system's trust) of a job's connections."""

    app_code: str = DEFAULT_APP_CODE
    secret: str = field(default="", repr=False)
    tls_ca: str | None = None

    def credentials(self) -> ClientCredentials | None:
        """What a broker connection authenticates with, or None without a secret."""
        if not self.secret:
            return None
        from qmq.auth.handshake import ClientCredentials

        return ClientCredentials(self.app_code, self.secret)

    def authorization(self) -> str | None:
        """The ``Authorization`` header of meta server requests, or None without a secret."""
        if not self.secret:
            return None
        from qmq.auth.http import basic_authorization

        return basic_authorization(self.app_code, self.secret)

    def tls(self, meta_server: str | None) -> ssl.SSLContext | None:
        """The TLS context of the job's connections: one trusting ``tls_ca``, the default one for
        an ``https://`` meta server, else None (plaintext)."""
        if self.tls_ca is not None:
            return ssl.create_default_context(cafile=self.tls_ca)
        if meta_server is not None and meta_server.startswith("https://"):
            return ssl.create_default_context()
        return None


def environment_options() -> dict[str, str]:
    """The ``app_code``, ``secret`` and ``tls_ca`` options of this process's environment
    ($QMQ_APP_CODE, $QMQ_SECRET, $QMQ_TLS_CA), for the jobs (archive, trace) to hand a read
    explicitly: Spark plans a Python data source in a worker process, whose environment is the
    one its JVM started with. Spark redacts the ``secret`` option in its plans and UI."""
    names = {"app_code": APP_CODE_ENV, "secret": SECRET_ENV, "tls_ca": TLS_CA_ENV}
    return {option: os.environ[env] for option, env in names.items() if os.environ.get(env)}


def access_of(options: Mapping[str, str]) -> Access:
    """The ``app_code``, ``secret`` and ``tls_ca`` options (keys in lower case; ``appCode`` and
    ``tlsCa`` too), else the environment ($QMQ_APP_CODE, $QMQ_SECRET, $QMQ_TLS_CA). ConfigError
    for a CA file that cannot be read."""
    app_code = options.get("app_code") or options.get("appcode") or os.environ.get(APP_CODE_ENV) or DEFAULT_APP_CODE
    secret = options.get("secret") or os.environ.get(SECRET_ENV, "")
    tls_ca = options.get("tls_ca") or options.get("tlsca") or os.environ.get(TLS_CA_ENV) or None
    if tls_ca is not None:
        try:
            ssl.create_default_context(cafile=tls_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(
                f"option tls_ca={tls_ca!r} cannot be read as a PEM CA certificate ({exc}); "
                "give the CA file that signed the servers' certificates"
            ) from None
    return Access(app_code, secret, tls_ca)
