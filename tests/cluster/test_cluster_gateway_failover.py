"""Receipts held across a broker failover (issue 19): messages pulled through a gateway are held
on the broker group's master until acked, nacked or their ack timeout; kill -9 of that master
(the meta server promotes its slave) loses none of it: the gateway takes the holds again on the
new master, an ack made there before the timeout is honoured, and the rest come back once each,
after their ack timeout and not before (the new master does not hand them out again at once).
The same when the master is killed and started again at its own address (no slave): the gateway
sees its connection to it was lost and takes the holds again on the restarted master."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config

from qmq.cli.cluster_launch import child_env, start

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(240)]

SUBJECT = "gw.failover"
GROUP = "http"
ACK_TIMEOUT_MS = 15_000  # well past the promotion (a master silent 2 s is replaced) on a busy machine
SENT = 10
ACKED_EARLY = 3


def _post(url: str, doc: object) -> tuple[int, Any]:
    request = urllib.request.Request(url, data=json.dumps(doc).encode(), headers={"Content-Type": "application/json"})
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))
    try:
        with opener.open(request, timeout=60) as resp:
            return int(resp.status), json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def _promoted(c: LocalCluster) -> None:
    slave = c.member("b1-s1").ready["address"]
    c.wait_view(
        "b1's slave promoted",
        lambda v: any(g["group"] == "b1" and g["epoch"] == 2 and g["master"] == slave for g in v["groups"]),
    )


def _restarted_in_place(c: LocalCluster, started: list[subprocess.Popen[bytes]]) -> None:
    """kill -9 of b1's master, then started again on the same port (added to ``started``)."""
    state = c.file()
    [master] = [m for m in state.members if m.name == "b1-m"]
    address = master.ready["address"]
    os.kill(master.pid, signal.SIGKILL)
    c.wait_view("b1 unavailable", lambda v: any(g["group"] == "b1" and g["state"] != "available" for g in v["groups"]))
    port = address.rsplit(":", 1)[1]
    if "--port" in master.argv:
        master.argv[master.argv.index("--port") + 1] = port
    else:
        master.argv += ["--port", port]
    started.append(start(master, child_env("WARNING")))
    state.save()  # so `cluster down` stops the new process
    c.wait_view(
        "b1's master back at its address",
        lambda v: any(g["group"] == "b1" and g["state"] == "available" and g["master"] == address for g in v["groups"]),
    )


def test_holds_survive_a_failover_of_the_master(tmp_path: Path) -> None:
    args = ["--broker-groups", "1", "--slaves", "1", "--delay-groups", "0", "--gateways", "1"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        c.wait_view("the slave replicating", lambda v: any(s["replicated_ms"] for s in v["servers"]))
        _holds_survive(c, lambda: (os.kill(c.member("b1-m").pid, signal.SIGKILL), _promoted(c)))


def test_holds_survive_a_restart_of_the_master_at_its_address(tmp_path: Path) -> None:
    args = ["--broker-groups", "1", "--slaves", "0", "--delay-groups", "0", "--gateways", "1"]
    started: list[subprocess.Popen[bytes]] = []
    try:
        with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
            _holds_survive(c, lambda: _restarted_in_place(c, started))
    finally:
        for proc in started:  # stopped by `cluster down`; reaped here
            if proc.poll() is None:
                proc.kill()
            proc.wait(30)


def _holds_survive(c: LocalCluster, fault: Callable[[], object]) -> None:
    gw = c.ready["gateways"].split(",")[0]
    pull_url = f"{gw}/v1/subjects/{SUBJECT}/groups/{GROUP}/pull"
    assert _post(pull_url, {"timeout_ms": 0, "start_from": "earliest"})[0] == 200  # the group exists
    batch = {"messages": [{"body": f"m{i}", "message_id": f"m{i}"} for i in range(SENT)]}
    assert _post(f"{gw}/v1/subjects/{SUBJECT}/messages", batch)[0] == 200
    got: list[dict[str, Any]] = []
    deadline = time.monotonic() + 30
    while len(got) < SENT and time.monotonic() < deadline:
        status, doc = _post(pull_url, {"max_messages": SENT, "timeout_ms": 1000, "ack_timeout_ms": ACK_TIMEOUT_MS})
        assert status == 200, doc
        got += doc["messages"]
    pulled_at = time.monotonic()
    assert sorted(m["message_id"] for m in got) == sorted(f"m{i}" for i in range(SENT))

    fault()
    # an ack before the ack timeout, through the new master, is honoured
    early = got[:ACKED_EARLY]
    while True:
        status, doc = _post(f"{gw}/v1/acks", {"acks": [m["receipt"] for m in early]})
        if status == 200:
            break
        assert status == 503, doc  # the gateway has not heard of the new master yet
        assert time.monotonic() < pulled_at + ACK_TIMEOUT_MS / 1000 - 2, "the ack could not be made in time"
        time.sleep(0.2)  # asking again, bounded by the ack timeout
    assert [r["status"] for r in doc["results"]] == ["acked"] * ACKED_EARLY

    # pull until well past the deadline: the others come back once each, not before it
    again: list[tuple[float, dict[str, Any]]] = []
    end = pulled_at + ACK_TIMEOUT_MS / 1000 + 10
    while time.monotonic() < end:
        status, doc = _post(pull_url, {"max_messages": SENT, "timeout_ms": 500, "ack_timeout_ms": 60_000})
        if status != 200:
            assert status == 503, doc
            time.sleep(0.2)  # between masters: ask again
            continue
        again += [(time.monotonic() - pulled_at, m) for m in doc["messages"]]
    ids = Counter(m["message_id"] for _at, m in again)
    assert ids == Counter(m["message_id"] for m in got[ACKED_EARLY:]), again
    for at, m in again:
        assert at >= ACK_TIMEOUT_MS / 1000 - 0.5, (
            f"{m['message_id']} came back after {at:.1f} s, before its timeout"
        )
        assert m["times"] == 2, m
    status, doc = _post(f"{gw}/v1/acks", {"acks": [m["receipt"] for _at, m in again]})
    assert [r["status"] for r in doc["results"]] == ["acked"] * len(again)
    assert _post(pull_url, {"timeout_ms": 1500}) == (200, {"messages": []})
    # the new master gave them back at their deadline (the holds were taken there again), not the
    # gateway's own give-back a few seconds later
    with urllib.request.urlopen(f"{gw}/health", timeout=10) as resp:
        health = json.loads(resp.read())
    assert SENT - ACKED_EARLY <= health["holds_taken_again"] <= SENT, health  # before or after the acks
    assert health["expired"] == 0, health
