"""TLS of a server role, configured once here: the context every listening port of the role
serves with (frames, /metrics and /health, the meta server's HTTP), and the context the role
connects to the others with (registration, replication, delay hand-over).

``tls_cert`` and ``tls_key`` turn TLS on; ``tls_ca`` makes every port require a client
certificate signed by that CA, and is also what the role trusts when it connects out (without
it, the system's CAs and $SSL_CERT_FILE). TLS 1.2 is the least version taken.
"""

from __future__ import annotations

import ssl
from typing import Protocol

from qmq.common.errors import ConfigError


class TlsConfig(Protocol):
    @property
    def tls_cert(self) -> str: ...
    @property
    def tls_key(self) -> str: ...
    @property
    def tls_ca(self) -> str: ...


def tls_on(config: TlsConfig) -> bool:
    return bool(config.tls_cert)


def check_tls(config: TlsConfig) -> None:
    """ConfigError when the TLS settings do not go together."""
    if bool(config.tls_cert) != bool(config.tls_key):
        raise ConfigError("TLS needs both --tls-cert and --tls-key (a certificate and its private key), or neither")
    if config.tls_ca and not config.tls_cert:
        raise ConfigError("--tls-ca (require client certificates) needs TLS on: pass --tls-cert and --tls-key too")


def _load_chain(ctx: ssl.SSLContext, config: TlsConfig) -> None:
    try:
        ctx.load_cert_chain(config.tls_cert, config.tls_key)
    except FileNotFoundError as exc:
        raise ConfigError(f"TLS: {exc.filename!r} does not exist; check --tls-cert and --tls-key") from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(
            f"TLS: cannot load certificate {config.tls_cert!r} with key {config.tls_key!r}: {exc}; "
            "pass a PEM certificate (chain) and its PEM private key"
        ) from None


def _load_ca(ctx: ssl.SSLContext, ca: str) -> None:
    try:
        ctx.load_verify_locations(cafile=ca)
    except FileNotFoundError:
        raise ConfigError(f"TLS: CA file {ca!r} does not exist; check --tls-ca") from None
    except (ssl.SSLError, OSError) as exc:
        raise ConfigError(f"TLS: cannot load CA file {ca!r}: {exc}; pass PEM certificates") from None


def server_context(config: TlsConfig) -> ssl.SSLContext | None:
    """The context the role's ports serve with, or None without TLS; ConfigError naming a bad file."""
    check_tls(config)
    if not tls_on(config):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    _load_chain(ctx, config)
    if config.tls_ca:
        _load_ca(ctx, config.tls_ca)
        ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


def outgoing_context(config: TlsConfig) -> ssl.SSLContext | None:
    """The context the role connects to the other roles with (its certificate as the client's),
    or None without TLS."""
    check_tls(config)
    if not tls_on(config):
        return None
    ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_2
    if config.tls_ca:
        _load_ca(ctx, config.tls_ca)
    _load_chain(ctx, config)
    return ctx
