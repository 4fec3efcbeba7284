"""The challenge-response a connection authenticates with once, before any other request.

    client → HELLO   {app, client_nonce}
    server → CHALLENGE {salt, log2_n, r, p, server_nonce}
    client → PROOF   {proof}
    server → OK, or a refusal naming the app and nothing else

The proof is SCRAM's (RFC 5802), over the keys of ``qmq.auth.secrets``::

    auth_message = "qmq-auth-1" | app | client_nonce | server_nonce
    proof        = client_key XOR HMAC-SHA256(stored_key, auth_message)

and the server checks ``SHA-256(proof XOR HMAC(stored_key, auth_message)) == stored_key``.
The secret never crosses the wire; the server nonce is fresh for each challenge and a
handshake takes one proof, so a recorded handshake replayed on another connection fails.
An app the file does not know gets a challenge like any other (a salt derived from its name),
so the answer does not tell which app codes exist.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from qmq.auth.file import App, AuthConfig
from qmq.auth.secrets import (
    LOG2_N_DEFAULT,
    LOG2_N_MAX,
    P_DEFAULT,
    P_MAX,
    R_DEFAULT,
    R_MAX,
    SALT_BYTES,
    client_key_of,
    salted_key,
    stored_key_of,
)

NONCE_BYTES = 18
_NONCE_BYTES_MAX = 64
_KEY_BYTES = 32
_CONTEXT = b"qmq-auth-1"


class HandshakeError(Exception):
    """The peer broke the handshake (a missing field, a step out of order): a protocol error."""


class AuthFailed(Exception):
    """The proof is wrong (or the app unknown): the text names the app only."""

    def __init__(self, app_code: str) -> None:
        self.app_code = app_code
        super().__init__(f"app {app_code!r} could not authenticate: unknown app or wrong secret")


def _auth_message(app_code: str, client_nonce: bytes, server_nonce: bytes) -> bytes:
    app = app_code.encode("utf-8")
    return b"\0".join((_CONTEXT, len(app).to_bytes(2, "big") + app, client_nonce, server_nonce))


def _xor(a: bytes, b: bytes) -> bytes:
    return bytes(x ^ y for x, y in zip(a, b, strict=True))


def _field(msg: dict[str, Any], name: str, kind: type, size_max: int) -> Any:
    value = msg.get(name)
    if not isinstance(value, str | bytes) or not isinstance(value, kind) or not value or len(value) > size_max:
        raise HandshakeError(f"handshake field {name!r} is missing or not a {kind.__name__} of at most {size_max}")
    return value


@dataclass(frozen=True, slots=True)
class Challenge:
    salt: bytes
    log2_n: int
    r: int
    p: int
    server_nonce: bytes

    def to_wire(self) -> dict[str, Any]:
        return {"salt": self.salt, "log2_n": self.log2_n, "r": self.r, "p": self.p, "server_nonce": self.server_nonce}


class ServerHandshake:
    """The server's side for one connection: ``challenge(hello)`` then ``verify(proof)``, once each."""

    def __init__(self, auth: AuthConfig, decoy_key: bytes, nonce: Callable[[int], bytes] = os.urandom) -> None:
        self._auth = auth
        self._decoy_key = decoy_key  # per server: derives the salts of unknown apps
        self._nonce = nonce
        self._pending: tuple[str, bytes, bytes, App | None] | None = None
        self.done = False

    def challenge(self, hello: dict[str, Any]) -> Challenge:
        if self.done or self._pending is not None:
            raise HandshakeError("a connection sends one HELLO, before its proof")
        app_code = _field(hello, "app", str, 200)
        client_nonce = _field(hello, "client_nonce", bytes, _NONCE_BYTES_MAX)
        server_nonce = self._nonce(NONCE_BYTES)
        app = self._auth.app(app_code)
        if app is None:
            salt = hmac.digest(self._decoy_key, app_code.encode("utf-8"), "sha256")[:SALT_BYTES]
            challenge = Challenge(salt, LOG2_N_DEFAULT, R_DEFAULT, P_DEFAULT, server_nonce)
        else:
            s = app.secret
            challenge = Challenge(s.salt, s.log2_n, s.r, s.p, server_nonce)
        self._pending = (app_code, client_nonce, server_nonce, app)
        return challenge

    @property
    def app_code(self) -> str | None:
        return None if self._pending is None else self._pending[0]

    def verify(self, proof_msg: dict[str, Any]) -> App:
        """The authenticated app; AuthFailed for a wrong proof. A handshake verifies one proof."""
        if self.done or self._pending is None:
            raise HandshakeError("a proof comes once, after a HELLO")
        app_code, client_nonce, server_nonce, app = self._pending
        self.done = True
        proof = _field(proof_msg, "proof", bytes, _KEY_BYTES)
        if app is None or len(proof) != _KEY_BYTES:
            raise AuthFailed(app_code)
        signature = hmac.digest(app.secret.stored_key, _auth_message(app_code, client_nonce, server_nonce), "sha256")
        if not hmac.compare_digest(hashlib.sha256(_xor(proof, signature)).digest(), app.secret.stored_key):
            raise AuthFailed(app_code)
        return app


class ClientCredentials:
    """An app code and its secret, on the client: makes HELLOs and proofs. The salted key of
    the last challenge's salt is kept, so reconnecting does not pay scrypt again."""

    def __init__(self, app_code: str, secret: str, nonce: Callable[[int], bytes] = os.urandom) -> None:
        self.app_code = app_code
        self._secret = secret
        self._nonce = nonce
        self._cached: tuple[tuple[bytes, int, int, int], bytes] | None = None

    def __repr__(self) -> str:  # never the secret
        return f"ClientCredentials(app_code={self.app_code!r})"

    def hello(self) -> tuple[dict[str, Any], bytes]:
        """The HELLO to send and its client nonce (kept for ``proof``)."""
        client_nonce = self._nonce(NONCE_BYTES)
        return {"app": self.app_code, "client_nonce": client_nonce}, client_nonce

    def proof(self, challenge: dict[str, Any], client_nonce: bytes) -> dict[str, Any]:
        salt = _field(challenge, "salt", bytes, 64)
        server_nonce = _field(challenge, "server_nonce", bytes, _NONCE_BYTES_MAX)
        params = (salt, int(challenge.get("log2_n", 0)), int(challenge.get("r", 0)), int(challenge.get("p", 0)))
        if self._cached is not None and self._cached[0] == params:
            client_key = self._cached[1]
        else:
            _salt, log2_n, r, p = params
            if not (1 <= log2_n <= LOG2_N_MAX and 1 <= r <= R_MAX and 1 <= p <= P_MAX):
                raise HandshakeError(f"the server asked for scrypt n=2**{log2_n}, r={r}, p={p}, past the limits")
            client_key = client_key_of(salted_key(self._secret, log2_n, r, p, salt))
            self._cached = (params, client_key)
        stored_key = stored_key_of(client_key)
        signature = hmac.digest(stored_key, _auth_message(self.app_code, client_nonce, server_nonce), "sha256")
        return {"proof": _xor(client_key, signature)}
