"""The push signature against the published HMAC-SHA256 test vector, and the subscription JSON
round trip (no server needed)."""

from __future__ import annotations

import pytest

from qmq.gateway.push_delivery import signature
from qmq.protocol.push import PushFieldError, PushSubscription, parse_subscription, subscription_json


def test_signature_is_the_lowercase_hex_hmac_sha256_of_the_body() -> None:
    # the well-known HMAC-SHA256 example: key "key", the quick brown fox
    assert signature("key", b"The quick brown fox jumps over the lazy dog") == (
        "sha256=f7bc83f430538424b13298e6aa6fb143ef4d59a14946175997479dbc2d1a3cd8"
    )


def test_a_subscription_round_trips_through_its_json() -> None:
    sub = PushSubscription(
        "orders", "billing", "https://h.example:8443/x?y=1", 3, 7, 900, "s", ("a",), "and", "earliest", 2, (1, 2)
    )
    assert parse_subscription(subscription_json(sub, with_secret=True)) == sub
    assert subscription_json(sub, with_secret=False)["secret"] == "***"
    assert subscription_json(PushSubscription("o", "g", "http://h/"), with_secret=False)["secret"] == ""


@pytest.mark.parametrize(
    ("url", "words"),
    [
        ("http://h:99999/", "cannot be parsed"),
        ("http://h /x", "whitespace"),
        ("mailto:a@b", "http:// or https://"),
        ("", "non-empty"),
    ],
)
def test_a_bad_url_is_named(url: str, words: str) -> None:
    with pytest.raises(PushFieldError, match=words) as info:
        parse_subscription({"subject": "s", "group": "g", "url": url})
    assert info.value.field == "url"
