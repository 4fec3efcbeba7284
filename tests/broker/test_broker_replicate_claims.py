"""What a client claiming to be a slave (a REPLICATE frame) can do to a master: nothing to its
writes. Only the slaves the meta server names count toward the group's write state, and no
REPLICATE counts offsets past the end of the master's logs.

Found by the fault campaign's hostile-clients scenario: one mutated REPLICATE frame (slave
"x:1", which then never asked again) turned a master without slaves read-only for good after
slave_timeout_ms, and every send of the load was refused from then on."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from rawclient import RawClient, broker_client, message

from qmq.protocol.codes import RequestCode, Status

pytestmark = pytest.mark.integration

_SLAVE_TIMEOUT_MS = 300


def claim_to_be_a_slave(address: str, epoch: int, offset: int = 0, slave: str = "x:1") -> tuple[int, dict[str, object]]:
    """A REPLICATE on a connection of its own, as a slave named ``slave`` would send it; (status, header)."""
    client = RawClient(address)
    try:
        answer = client.call(
            RequestCode.REPLICATE,
            {"from": offset, "action_from": offset, "epoch": epoch, "max_bytes": 1024, "timeout_ms": 0, "slave": slave},
        )
    finally:
        client.close()
    return answer.status, dict(answer.header)


def test_a_client_claiming_to_be_a_slave_never_turns_a_lone_master_read_only(tmp_path: Path) -> None:
    with broker_client(tmp_path, {"slave_timeout_ms": _SLAVE_TIMEOUT_MS}) as client:
        host, port = client.sock.getpeername()[:2]
        status, _header = claim_to_be_a_slave(f"{host}:{port}", 0)  # a broker never in a group: epoch 0
        assert status == Status.OK  # what is in the log may be read; being counted as a slave is another thing
        # the "slave" never asks again: wait past slave_timeout_ms, after which a counted slave
        # would have made the group read-only (what is checked is that nothing happens)
        time.sleep(3 * _SLAVE_TIMEOUT_MS / 1000)
        answer = client.send(message("claims.s", "m-1"))
        assert answer.status == Status.OK, answer.header
