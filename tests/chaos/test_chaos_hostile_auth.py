"""The probes of the campaign's `hostile_auth` scenario against a real standalone: with the
auth file every hostile client is refused and told nothing, and the same probes against a
standalone without one find the door open (so they can fail)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from chaos.scenarios.hostile_auth import (
    CLUSTER_SECRET,
    auth_file_text,
    forbidden_frames_as_intruder,
    guessing_while_serving,
    meta_http,
    sdk_clients,
    unauthenticated_frames,
)

from qmq.testing import ReadyProcess, running_standalone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


@pytest.fixture(scope="module")
def secured(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ReadyProcess]:
    tmp = tmp_path_factory.mktemp("hostile-auth")
    auth = tmp / "auth.toml"
    auth.write_text(auth_file_text())
    args = ["--auth-file", str(auth), "--app-code", "qmq-cluster"]
    with running_standalone(tmp / "data", extra_args=args, env={"QMQ_SECRET": CLUSTER_SECRET}) as proc:
        yield proc


def _addresses(proc: ReadyProcess) -> tuple[str, str]:
    return proc.ready["broker"], proc.ready["delay"]


async def test_every_hostile_client_is_refused_and_told_nothing(secured: ReadyProcess) -> None:
    broker, delay = _addresses(secured)
    said: list[str] = []
    assert "UNAUTHENTICATED" in unauthenticated_frames(broker, "broker", said)
    assert "UNAUTHENTICATED" in unauthenticated_frames(delay, "delay server", said)
    notes = await sdk_clients(secured.meta_server, said)
    assert any("wrong permission" in n for n in notes)
    assert "FORBIDDEN" in forbidden_frames_as_intruder(broker)
    base = secured.meta_server.removesuffix("/meta/address")
    assert "POST /meta/promote, intruder 403" in meta_http(base, [broker, delay])
    note = await guessing_while_serving(broker, secured.meta_server, 13)
    assert "the right secret then got in" in note
    assert not [s for s in said if CLUSTER_SECRET in s]


async def test_the_probes_find_an_open_server(tmp_path: Path) -> None:
    with running_standalone(tmp_path / "data") as proc:
        broker, _delay = _addresses(proc)
        with pytest.raises(AssertionError, match="before any handshake was answered OK"):
            unauthenticated_frames(broker, "broker", [])
        with pytest.raises(AssertionError, match="was let in"):
            await sdk_clients(proc.meta_server, [])
        with pytest.raises(AssertionError, match="answered 200"):
            meta_http(proc.meta_server.removesuffix("/meta/address"), [broker])
