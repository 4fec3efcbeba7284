"""The challenge-response: a right secret gets in, a wrong one and a replay do not, and nothing
on the wire holds the secret."""

from __future__ import annotations

import os

import msgpack
import pytest

from qmq.auth.failures import DELAY_MAX_S, FREE_FAILURES, WINDOW_S, FailedHandshakes, address_of
from qmq.auth.file import parse_auth
from qmq.auth.handshake import AuthFailed, ClientCredentials, HandshakeError, ServerHandshake
from qmq.auth.secrets import hash_secret

SECRET = "correct horse battery staple"
AUTH = parse_auth(
    {"apps": {"shop": {"secret_hash": hash_secret(SECRET, log2_n=6), "produce": ["order.*"]}}}, "test auth"
)
DECOY = os.urandom(32)


def handshake(creds: ClientCredentials, server: ServerHandshake) -> tuple[bytes, str]:
    """Run one handshake; the bytes that crossed the wire and the app it authenticated."""
    hello, client_nonce = creds.hello()
    challenge = server.challenge(hello).to_wire()
    proof = creds.proof(challenge, client_nonce)
    app = server.verify(proof)
    return msgpack.packb([hello, challenge, proof]), app.code


def test_the_right_secret_gets_in_and_never_crosses_the_wire() -> None:
    wire, app = handshake(ClientCredentials("shop", SECRET), ServerHandshake(AUTH, DECOY))
    assert app == "shop"
    assert SECRET.encode() not in wire


def test_a_wrong_secret_is_refused_naming_the_app_only() -> None:
    with pytest.raises(AuthFailed) as info:
        handshake(ClientCredentials("shop", "wrong"), ServerHandshake(AUTH, DECOY))
    assert str(info.value) == "app 'shop' could not authenticate: unknown app or wrong secret"


def test_an_unknown_app_looks_like_a_known_one() -> None:
    creds = ClientCredentials("nobody", SECRET)
    hello, nonce = creds.hello()
    first = ServerHandshake(AUTH, DECOY).challenge(hello)
    again = ServerHandshake(AUTH, DECOY).challenge(hello)
    assert first.salt == again.salt  # a stable made-up salt: probing twice tells nothing
    server = ServerHandshake(AUTH, DECOY)
    proof = creds.proof(server.challenge(hello).to_wire(), nonce)
    with pytest.raises(AuthFailed, match="'nobody'"):
        server.verify(proof)


def test_a_replayed_handshake_fails() -> None:
    creds = ClientCredentials("shop", SECRET)
    hello, client_nonce = creds.hello()
    server = ServerHandshake(AUTH, DECOY)
    proof = creds.proof(server.challenge(hello).to_wire(), client_nonce)
    assert server.verify(proof).code == "shop"
    # an eavesdropper sends the recorded HELLO and proof on a new connection: a new server nonce
    replay = ServerHandshake(AUTH, DECOY)
    replay.challenge(hello)
    with pytest.raises(AuthFailed):
        replay.verify(proof)
    # and the same handshake takes no second proof
    with pytest.raises(HandshakeError):
        server.verify(proof)


def test_steps_out_of_order_and_bad_fields_are_protocol_errors() -> None:
    server = ServerHandshake(AUTH, DECOY)
    with pytest.raises(HandshakeError):
        server.verify({"proof": b"x" * 32})
    with pytest.raises(HandshakeError, match="'app'"):
        server.challenge({"client_nonce": b"n"})
    server.challenge({"app": "shop", "client_nonce": b"n"})
    with pytest.raises(HandshakeError):
        server.challenge({"app": "shop", "client_nonce": b"n"})
    with pytest.raises(HandshakeError, match="'proof'"):
        server.verify({"proof": "text"})


def test_a_client_refuses_a_challenge_past_the_scrypt_limits() -> None:
    creds = ClientCredentials("shop", SECRET)
    with pytest.raises(HandshakeError, match="past the limits"):
        creds.proof({"salt": b"s", "server_nonce": b"n", "log2_n": 40, "r": 8, "p": 1}, b"c")


def test_credentials_do_not_show_the_secret() -> None:
    assert SECRET not in repr(ClientCredentials("shop", SECRET))


def test_failed_handshakes_delay_an_address_after_ten_within_a_minute() -> None:
    failures = FailedHandshakes()
    for i in range(FREE_FAILURES - 1):
        failures.failed("10.0.0.1", 100.0 + i)
    assert failures.delay_s("10.0.0.1", 110.0) == 0.0
    failures.failed("10.0.0.1", 110.0)
    delays = []
    for i in range(20):
        delays.append(failures.delay_s("10.0.0.1", 111.0 + i / 10))
        failures.failed("10.0.0.1", 111.0 + i / 10)
    assert 0 < delays[0] < delays[5] <= DELAY_MAX_S
    assert max(delays) == DELAY_MAX_S  # bounded: delayed, never refused
    assert failures.delay_s("10.0.0.2", 112.0) == 0.0  # others unaffected
    assert failures.delay_s("10.0.0.1", 113.0 + WINDOW_S) == 0.0  # the window passes


def test_the_table_of_addresses_is_bounded() -> None:
    failures = FailedHandshakes(addresses_max=3)
    for i in range(10):
        failures.failed(f"10.0.0.{i}", 1.0)
    assert len(failures) == 3


def test_address_of_a_peer() -> None:
    assert address_of("127.0.0.1:5555") == "127.0.0.1"
    assert address_of("::1:5555") == "::1"
