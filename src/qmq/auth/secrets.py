"""Secret hashing: what the auth file keeps of an app's secret, and the keys both ends of a
handshake derive from it.

The value ``qmq auth hash`` prints and the auth file's ``secret_hash`` holds::

    scrypt$<log2 n>$<r>$<p>$<salt, base64>$<stored key, base64>

Derived as SCRAM (RFC 5802) does, with scrypt in place of PBKDF2::

    salted_key = scrypt(secret, salt, n, r, p)          # only the client computes it
    client_key = HMAC-SHA256(salted_key, "Client Key")
    stored_key = SHA-256(client_key)                    # what the auth file keeps

So the auth file alone does not let its reader authenticate as the app: a handshake proves
knowledge of ``client_key``, which the stored key does not give back.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import os
from dataclasses import dataclass

from qmq.common.errors import ConfigError

SCHEME = "scrypt"
# scrypt's cost: n = 2**14, r = 8 takes 16 MiB and some tens of milliseconds, once per
# connection on the client and once per new secret on an HTTP server (which caches it).
LOG2_N_DEFAULT = 14
R_DEFAULT = 8
P_DEFAULT = 1
SALT_BYTES = 16
# bounds on what a secret_hash may ask of the machine that derives it (memory is 128 * n * r)
LOG2_N_MAX = 20
R_MAX = 16
P_MAX = 4
_SCRYPT_MAXMEM_BYTES = 256 * 1024 * 1024
SECRET_CHARS_MAX = 1024


@dataclass(frozen=True, slots=True)
class SecretHash:
    """A parsed ``secret_hash``: the scrypt parameters and salt, and the stored key."""

    log2_n: int
    r: int
    p: int
    salt: bytes
    stored_key: bytes

    def encode(self) -> str:
        salt = base64.b64encode(self.salt).decode()
        key = base64.b64encode(self.stored_key).decode()
        return f"{SCHEME}${self.log2_n}${self.r}${self.p}${salt}${key}"


def check_secret(secret: str) -> bytes:
    """The secret as bytes; ConfigError for an empty or oversized one."""
    if not secret:
        raise ConfigError("the secret is empty; pass a non-empty secret (--secret, $QMQ_SECRET or stdin)")
    if len(secret) > SECRET_CHARS_MAX:
        raise ConfigError(f"the secret has {len(secret)} characters; the limit is {SECRET_CHARS_MAX}")
    return secret.encode("utf-8")


def salted_key(secret: str, log2_n: int, r: int, p: int, salt: bytes) -> bytes:
    data = check_secret(secret)
    return hashlib.scrypt(data, salt=salt, n=1 << log2_n, r=r, p=p, maxmem=_SCRYPT_MAXMEM_BYTES, dklen=32)


def client_key_of(salted: bytes) -> bytes:
    return hmac.digest(salted, b"Client Key", "sha256")


def stored_key_of(client_key: bytes) -> bytes:
    return hashlib.sha256(client_key).digest()


def hash_secret(
    secret: str, *, log2_n: int = LOG2_N_DEFAULT, r: int = R_DEFAULT, p: int = P_DEFAULT, salt: bytes | None = None
) -> str:
    """The ``secret_hash`` value of ``secret``, with a fresh random salt unless one is given."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    stored = stored_key_of(client_key_of(salted_key(secret, log2_n, r, p, salt)))
    return SecretHash(log2_n, r, p, salt, stored).encode()


def parse_secret_hash(value: object, where: str) -> SecretHash:
    """A ``secret_hash`` read from ``where`` (the auth file's app); ConfigError naming what is wrong."""
    hint = "make one with `qmq auth hash`"
    if not isinstance(value, str):
        raise ConfigError(f"{where}: secret_hash must be a string; {hint}")
    parts = value.split("$")
    if len(parts) != 6 or parts[0] != SCHEME:
        raise ConfigError(f"{where}: secret_hash is not of the form scrypt$n$r$p$salt$key; {hint}")
    try:
        log2_n, r, p = int(parts[1]), int(parts[2]), int(parts[3])
        salt = base64.b64decode(parts[4], validate=True)
        stored = base64.b64decode(parts[5], validate=True)
    except (ValueError, binascii.Error):
        raise ConfigError(f"{where}: secret_hash has a part that is not a number or base64; {hint}") from None
    if not (1 <= log2_n <= LOG2_N_MAX and 1 <= r <= R_MAX and 1 <= p <= P_MAX):
        raise ConfigError(
            f"{where}: secret_hash asks for scrypt n=2**{log2_n}, r={r}, p={p}; "
            f"the limits are 2**{LOG2_N_MAX}, {R_MAX}, {P_MAX}; {hint}"
        )
    if not salt or len(stored) != 32:
        raise ConfigError(f"{where}: secret_hash has an empty salt or a key that is not 32 bytes; {hint}")
    return SecretHash(log2_n, r, p, salt, stored)


def secret_matches(secret: str, expected: SecretHash) -> bool:
    """Whether ``secret`` is the one ``expected`` was made from (constant-time comparison)."""
    try:
        salted = salted_key(secret, expected.log2_n, expected.r, expected.p, expected.salt)
    except ConfigError:
        return False
    return hmac.compare_digest(stored_key_of(client_key_of(salted)), expected.stored_key)
