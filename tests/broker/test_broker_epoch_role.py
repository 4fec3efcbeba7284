"""A broker remembers, with the epoch it served in, whether it was master or slave then: ``--role``
decides its first start only. Found by the fault campaign (chaos/, process kill): a slave
restarted with ``--role master`` reported master in its group's epoch, the meta server took it
for the master restarted at another address, and the group's two copies diverged."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qmq.broker.server import BrokerServer
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig


def _server(data_dir: Path, role: str) -> BrokerServer:
    return BrokerServer(BrokerConfig(data_dir=data_dir, group="b1", role=role, flush="periodic"), ManualClock())


def _close(server: BrokerServer) -> None:
    server.flusher.executor.shutdown()
    server.checkpoint_executor.shutdown()


@pytest.mark.parametrize(("saved", "given", "starts_as"), [
    ({"epoch": 6, "role": "slave"}, "master", "slave"),
    ({"epoch": 6, "role": "master"}, "slave", "master"),
    ({"epoch": 6}, "master", "master"),  # a file written before roles were kept: --role
    (None, "master", "master"),  # a first start: --role
])
def test_a_restarted_broker_starts_as_what_it_was_in_its_epoch(
    tmp_path: Path, saved: dict[str, object] | None, given: str, starts_as: str
) -> None:
    data = tmp_path / "broker"
    data.mkdir()
    if saved is not None:
        (data / "epoch").write_text(json.dumps(saved), encoding="utf-8")
    server = _server(data, given)
    try:
        assert server.role == starts_as
        assert server.epoch == (6 if saved else 0)
    finally:
        _close(server)


def test_following_a_master_writes_the_role_with_the_epoch(tmp_path: Path) -> None:
    data = tmp_path / "broker"
    server = _server(data, "master")
    server.store.open()
    try:
        server._set_epoch(7, "slave")
        assert json.loads((data / "epoch").read_text(encoding="utf-8")) == {"epoch": 7, "role": "slave"}
    finally:
        server.store.close()
        _close(server)
    again = _server(data, "master")
    try:
        assert (again.epoch, again.role) == (7, "slave")
    finally:
        _close(again)
