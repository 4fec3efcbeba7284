"""Who can reach a server without an auth file: only this machine, unless told otherwise.

Like Redis's protected mode: a role without ``--auth-file`` listens on a loopback address
only; another address needs ``--insecure``, and the server says at start that anyone who can
reach it may do anything.
"""

from __future__ import annotations

import ipaddress

from qmq.common.errors import ConfigError

_LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


def is_loopback(host: str) -> bool:
    if host.lower() in _LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a name: it may resolve to any address


def check_exposure(what: str, host: str, auth_file: str, insecure: bool) -> str | None:
    """ConfigError for a non-loopback ``host`` without an auth file or ``insecure``; with
    ``insecure``, the warning to log at start (None when there is nothing to say)."""
    if auth_file or is_loopback(host):
        return None
    if not insecure:
        raise ConfigError(
            f"the {what} would listen on {host} without authentication, open to anyone who can reach it; "
            "pass --auth-file FILE (docs/security.md), listen on 127.0.0.1, or pass --insecure to accept it"
        )
    return (
        f"the {what} listens on {host} WITHOUT authentication (--insecure): anyone who can reach it may send, "
        "consume and administer; use --auth-file to require apps and secrets"
    )
