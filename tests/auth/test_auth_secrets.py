"""Secret hashing: the secret_hash value, its parsing and its check."""

from __future__ import annotations

import pytest

from qmq.auth.secrets import hash_secret, parse_secret_hash, secret_matches
from qmq.common.errors import ConfigError


def test_a_hash_matches_its_secret_only() -> None:
    value = hash_secret("s3cret")
    parsed = parse_secret_hash(value, "test")
    assert value.startswith("scrypt$14$8$1$")
    assert secret_matches("s3cret", parsed)
    assert not secret_matches("s3cret ", parsed)
    assert not secret_matches("", parsed)


def test_each_hash_has_its_own_salt() -> None:
    assert hash_secret("same", log2_n=4) != hash_secret("same", log2_n=4)


def test_the_hash_does_not_hold_the_secret() -> None:
    assert "topsecret" not in hash_secret("topsecret", log2_n=4)


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (42, "must be a string"),
        ("bcrypt$x", "not of the form"),
        ("scrypt$14$8$1$!!!$AAAA", "not a number or base64"),
        ("scrypt$30$8$1$AAAA$" + "A" * 44, "limits"),
        ("scrypt$14$8$1$AAAA$AAAA", "not 32 bytes"),
    ],
)
def test_a_bad_secret_hash_is_named(value: object, says: str) -> None:
    with pytest.raises(ConfigError, match=says) as info:
        parse_secret_hash(value, "auth file 'x', [apps.shop]")
    assert "[apps.shop]" in str(info.value)
    assert "qmq auth hash" in str(info.value)
