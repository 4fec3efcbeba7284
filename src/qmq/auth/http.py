"""The ``Authorization`` header of the HTTP APIs (the meta server's, the gateway's): HTTP Basic,
``app_code:secret``, checked against the auth file's secret hashes. Over HTTP the secret does
cross the wire, so an HTTP port reachable from other machines belongs behind TLS
(``--tls-cert``/``--tls-key``).

scrypt is slow on purpose, so the check of an (app, secret) pair is remembered, bounded, and
forgotten when the auth file changes; a server runs ``verify`` off its event loop on a miss.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
from collections import OrderedDict

from qmq.auth.file import App, AuthConfig
from qmq.auth.secrets import secret_matches

CHECKED_PAIRS_MAX = 1024
_HEADER_CHARS_MAX = 4096


class HttpAuthError(Exception):
    """The header is missing or malformed, or the secret wrong: an answer of 401, with this text."""

    def __init__(self, text: str, app_code: str = "") -> None:
        self.app_code = app_code
        super().__init__(text)


def basic_authorization(app_code: str, secret: str) -> str:
    """The ``Authorization`` header value of an app and its secret."""
    return "Basic " + base64.b64encode(f"{app_code}:{secret}".encode()).decode("ascii")


def parse_authorization(value: str | None) -> tuple[str, str]:
    """(app code, secret) of a Basic ``Authorization`` header; HttpAuthError when there is none."""
    if not value:
        raise HttpAuthError(
            "this server needs an app code and secret: send an Authorization header "
            "(HTTP Basic, app_code:secret; curl -u app:secret)"
        )
    scheme, _, token = value.partition(" ")
    if scheme.lower() != "basic" or len(value) > _HEADER_CHARS_MAX:
        raise HttpAuthError("the Authorization header must be HTTP Basic: 'Basic ' + base64 of app_code:secret")
    try:
        app_code, sep, secret = base64.b64decode(token.strip(), validate=True).decode("utf-8").partition(":")
    except (binascii.Error, UnicodeDecodeError):
        raise HttpAuthError("the Authorization header is not base64 of app_code:secret in UTF-8") from None
    if not sep or not app_code:
        raise HttpAuthError("the Authorization header must hold app_code:secret")
    return app_code, secret


class HttpVerifier:
    """Checks (app, secret) pairs against an auth file, remembering the last ``CHECKED_PAIRS_MAX``."""

    def __init__(self, auth: AuthConfig) -> None:
        self.auth = auth
        self._checked: OrderedDict[bytes, bool] = OrderedDict()

    def reload(self, auth: AuthConfig) -> None:
        self.auth = auth
        self._checked.clear()

    def _key(self, app: App, secret: str) -> bytes:
        # the stored key is part of the key: a changed secret_hash is checked afresh
        return hashlib.sha256(b"\0".join((app.code.encode(), app.secret.stored_key, secret.encode()))).digest()

    def known(self, app_code: str, secret: str) -> bool:
        """Whether ``verify`` answers at once (a remembered pair, or an unknown app): no scrypt to run."""
        app = self.auth.app(app_code)
        return app is None or self._key(app, secret) in self._checked

    def verify(self, app_code: str, secret: str) -> App:
        """The app of a right pair (slow on a miss: scrypt); HttpAuthError naming the app otherwise."""
        app = self.auth.app(app_code)
        if app is not None:
            key = self._key(app, secret)
            seen = self._checked.get(key)
            if seen is None:
                seen = secret_matches(secret, app.secret)
                self._checked[key] = seen
                if len(self._checked) > CHECKED_PAIRS_MAX:
                    self._checked.popitem(last=False)
            if seen:
                return app
        raise HttpAuthError(f"app {app_code!r} could not authenticate: unknown app or wrong secret", app_code)
