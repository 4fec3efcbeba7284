"""The console runs the qmq command's calls as the person signed in: ACTING_FOR takes the place
of --app-code/--secret ($QMQ_APP_CODE, $QMQ_SECRET) for one request, and only for it."""

from __future__ import annotations

import asyncio

import pytest

from qmq.auth.http import basic_authorization
from qmq.cli.auth_commands import ACTING_FOR, cli_authorization, cli_credentials


def test_acting_for_wins_over_the_environment_and_ends_with_the_request(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QMQ_APP_CODE", "qmq-cluster")
    monkeypatch.setenv("QMQ_SECRET", "server-secret")
    token = ACTING_FOR.set(("ops", "o-secret"))
    try:
        assert cli_authorization() == basic_authorization("ops", "o-secret")
        credentials = cli_credentials()
        assert credentials is not None
        assert credentials.app_code == "ops"  # (its secret is private: the handshake proves it)
    finally:
        ACTING_FOR.reset(token)
    assert cli_authorization() == basic_authorization("qmq-cluster", "server-secret")


def test_no_secret_acting_means_no_credentials_not_the_servers(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QMQ_SECRET", "server-secret")
    token = ACTING_FOR.set(("", ""))
    try:
        assert cli_authorization() is None
        assert cli_credentials() is None
    finally:
        ACTING_FOR.reset(token)


def test_each_request_acts_for_its_own_person() -> None:
    async def request(who: str) -> str | None:
        ACTING_FOR.set((who, f"{who}-secret"))
        await asyncio.sleep(0.01)  # the other request runs meanwhile
        return await asyncio.to_thread(cli_authorization)  # also in the thread of a blocking call

    async def both() -> list[str | None]:
        return list(await asyncio.gather(request("ann"), request("bob")))

    assert asyncio.run(both()) == [basic_authorization("ann", "ann-secret"), basic_authorization("bob", "bob-secret")]
