"""Replacing a dead slave under load, on a cluster started by `qmq cluster up` (2 broker groups of
a master and a slave): a new slave started empty for b1 catches up from its master (its progress
in `qmq cluster status`), is promoted with `qmq admin promote`, and the dead slave's leftovers,
started again, rejoin as a slave of the new epoch, never in the older one. No send fails and no
acknowledged message is lost meanwhile."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest
from clusterhelpers import LocalCluster, cluster_up, fast_config, run_qmq

from qmq.aio import Consumer, Producer
from qmq.cli.cluster_launch import Member, child_env, start, wait_ready
from qmq.testing.load import Load

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(300)]

SUBJECT = "replace.orders"


def _new_slave(c: LocalCluster, old: Member) -> Member:
    """``old``'s command line with a new, empty data directory."""
    data_dir = str(c.data_dir.resolve() / "b1-s2")
    argv = list(old.argv)
    argv[argv.index("--data-dir") + 1] = data_dir
    log = str(Path(old.log).with_name("b1-s2.log"))
    return dataclasses.replace(old, name="b1-s2", data_dir=data_dir, argv=argv, log=log, pid=0, start_ticks=0, ready={})


def _row(view: dict[str, Any], pid: int) -> dict[str, Any] | None:
    return next((s for s in view["servers"] if s["pid"] == pid and s["state"] == "available"), None)


def _b1(view: dict[str, Any]) -> dict[str, Any]:
    return dict(next(g for g in view["groups"] if g["group"] == "b1"))


async def test_a_new_empty_slave_catches_up_is_promoted_and_the_old_one_never_rejoins_in_an_old_epoch(
    tmp_path: Path,
) -> None:
    args = ["--broker-groups", "2", "--slaves", "1", "--delay-groups", "0"]
    with cluster_up(tmp_path / "cluster", args, fast_config(tmp_path / "fast.toml")) as c:
        procs: list[subprocess.Popen[bytes]] = []  # started here: stopped here
        try:
            await asyncio.to_thread(
                c.wait_view,
                "both slaves replicating",
                lambda v: sum(1 for s in v["servers"] if s["role_in_group"] == "slave" and s["replicated_ms"] > 0) == 2,
            )
            async with (
                Producer(app_code="load", meta_server=c.meta_server, retry_backoff_ms=20) as producer,
                Consumer(app_code="billing", meta_server=c.meta_server, consumer_id="billing-1") as consumer,
            ):
                load = Load(producer, consumer.pull_consumer(SUBJECT, "billing", start_from="earliest"), SUBJECT)
                load.start()
                await load.until_acked(2_000)

                state = c.file()
                [dead] = [m for m in state.members if m.name == "b1-s1"]
                os.kill(dead.pid, signal.SIGKILL)  # the slave's machine is gone

                new = _new_slave(c, dead)
                proc = start(new, child_env("WARNING"))
                procs.append(proc)
                state.members.append(new)
                state.save()  # so `cluster down` stops it too
                await asyncio.to_thread(wait_ready, {new.name: proc}, [new], time.monotonic() + 60)

                # It copies the master's log from the start: cluster status shows how far it is.
                first = await asyncio.to_thread(
                    c.wait_view, "the new slave registered", lambda v: _row(v, new.pid) is not None
                )
                b1 = _b1(first)
                master_end = next(s["log_end"] for s in first["servers"] if s["address"] == b1["master"])
                assert master_end > 0
                status = await asyncio.to_thread(run_qmq, "cluster", "status", "--meta-server", c.meta_server)
                assert status.returncode == 0, status.stderr
                [line] = [ln for ln in status.stdout.splitlines() if f"\t{new.pid}\t" in ln]
                assert "copied" in line or "\t0\t" in line, line  # caught up already on a fast machine

                def caught_up(v: dict[str, Any]) -> bool:
                    row = _row(v, new.pid)
                    return (
                        row is not None
                        and row["epoch"] == 1
                        and row["replicated_ms"] > 0
                        and row["log_end"] >= master_end
                    )

                await asyncio.to_thread(c.wait_view, "the new slave caught up", caught_up, 90)
                await load.until_acked(len(load.record.acked) + 1_000)

                promoted = await asyncio.to_thread(run_qmq, "admin", "promote", "b1", "--meta-server", c.meta_server)
                assert promoted.returncode == 0, promoted.stderr
                new_address = new.ready["address"]
                assert f"promoted {new_address} to master of broker group b1 in epoch 2" in promoted.stdout

                # The dead slave's leftovers come back: a slave of epoch 2, never a master, never epoch 1.
                restarted = start(dead, child_env("WARNING"))
                procs.append(restarted)
                state.save()
                await asyncio.to_thread(
                    wait_ready, {dead.name: restarted}, [dead], asyncio.get_running_loop().time() + 60
                )

                def rejoined(v: dict[str, Any]) -> bool:
                    row = _row(v, dead.pid)
                    return row is not None and row["reported_role_in_group"] == "slave" and row["epoch"] == 2

                view = await asyncio.to_thread(c.wait_view, "the old slave rejoined in epoch 2", rejoined)
                assert _b1(view)["master"] == new_address
                assert _b1(view)["epoch"] == 2
                await load.until_acked(len(load.record.acked) + 1_000)
                await load.stop()

            r = load.record
            assert not r.failed, f"{len(r.failed)} sends failed, e.g. {r.failed[0]}"
            lost = r.acked.keys() - r.received
            assert not lost, f"{len(lost)} acknowledged messages never came to the consumer group"
            doc = run_qmq("admin", "history", "--json", "--meta-server", c.meta_server)
            assert '"promote"' in doc.stdout
        finally:
            for p in procs:
                if p.poll() is None:
                    p.terminate()
                p.wait(30)
