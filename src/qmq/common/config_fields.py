"""The pieces the role configurations (qmq.common.config) are built from: the field maker with
its checks, and the fields several roles share, each defined once.

A field's metadata holds its documentation (``doc``, shown by ``--help`` and in docs/) and
its check (``check``: None when the value is allowed, else what is allowed).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import field
from typing import Any, Literal

from qmq.common.limits import MiB


def _range(lo: float, hi: float) -> Callable[[Any], str | None]:
    def check(v: Any) -> str | None:
        return None if lo <= v <= hi else f"must be between {lo:g} and {hi:g}"

    return check


def _port(v: Any) -> str | None:
    return None if 0 <= v <= 65535 else "must be a TCP port, 0 to 65535 (0 picks a free port)"


def _opt(doc: str, default: Any, check: Callable[[Any], str | None] | None = None) -> Any:
    # Returns dataclasses.field(...); ruff's RUF009 cannot see through that, hence its noqa below.
    return field(default=default, metadata={"doc": doc, "check": check})


FlushPolicy = Literal["sync", "periodic"]


# Two fields every role that takes frames has (qmq.serving.connection), one definition each.
def _first_request_timeout_ms() -> Any:
    return _opt(
        "a connection that has sent no complete request this long after it opened is closed (clients send "
        "theirs as soon as they connect); one that has sent a request stays open however long it is quiet",
        10_000,
        _range(100, 3_600_000),
    )


def _auth_file() -> Any:
    return _opt(
        "TOML file of the apps that may connect, their secret hashes and what each may do "
        "(docs/security.md); empty: no authentication. Reloaded on SIGHUP",
        "",
    )


def _insecure() -> Any:
    return _opt(
        "listen on an address other than loopback without an auth file (anyone who can reach it may do "
        "anything); without it such a server refuses to start",
        False,
    )


def _tls_fields() -> tuple[Any, Any, Any]:
    return (
        _opt("PEM certificate (chain) every port of the role serves TLS with (docs/security.md); empty: no TLS", ""),
        _opt("PEM private key of tls_cert", ""),
        _opt(
            "PEM CA certificate(s): clients must present a certificate signed by it; also what the role "
            "trusts when it connects to the other roles (without it: the system's CAs and $SSL_CERT_FILE)",
            "",
        ),
    )


# The four fields of a role whose groups have slaves (brokers, delay servers), one definition each.
def _replication_fields() -> tuple[Any, Any, Any, Any]:
    return (
        _opt(
            "what this server starts as in its group; the meta server decides from then on (docs/cluster.md)",
            "master",
        ),
        _opt("when the group has a slave, acknowledge a send only once the slave has written it", True),
        _opt(
            "a master whose slave has not replicated for this long turns read-only (or degrades, see below)",
            10_000,
            _range(10, 3_600_000),
        ),
        _opt(
            "when the slave is gone, keep acknowledging sends on the master's copy alone instead of turning read-only",
            False,
        ),
    )


def _server_app_code() -> Any:
    return _opt(
        "the app this server authenticates as to the other roles of a cluster with auth files (an app "
        "with cluster = true there; docs/security.md); its secret comes from $QMQ_SECRET. Empty: none",
        "",
    )


def _connections_per_host_max() -> Any:
    return _opt(
        "most client connections at once from one host (IP address): one host's idle or hostile "
        "connections leave the rest of connections_max to the others",
        1024,
        _range(1, 1_000_000),
    )


def _reply_backlog_bytes_max() -> Any:
    return _opt(
        "bytes of replies one connection may hold that its client has not read; past it the connection is "
        "closed. A connection whose client does not read stops taking requests once 64 KiB wait, but answers "
        "to requests already taken (parked pulls) still come; at least 32 MiB, two of the largest frames",
        64 * MiB,
        _range(32 * MiB, 1 << 34),
    )


# The three fields of a role that can make server spans (brokers, delay servers; qmq.serving.tracing).
def _tracing_fields() -> tuple[Any, Any, Any]:
    return (
        _opt(
            "make OpenTelemetry spans of what this server does with messages that carry a sampled trace "
            "context (docs/observability.md); needs the otel-server extra",
            False,
        ),
        _opt(
            "of the traced messages, the fraction whose server spans are made (by trace id, so every server "
            "keeps the same traces)",
            1.0,
            _range(0, 1),
        ),
        _opt(
            "OTLP/HTTP endpoint the spans are exported to, e.g. http://127.0.0.1:4318/v1/traces; empty: the "
            "exporter's default and the OTEL_EXPORTER_OTLP_* environment variables",
            "",
        ),
    )
