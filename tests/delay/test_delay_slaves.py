"""A delay group of a master and a slave, each a real process behind a real meta server and
two broker groups: the slave copies and replays what its master takes before a send is answered; on
kill -9 of the master the meta server promotes the slave, which hands over what was still
pending, none of it twice to a consumer group and none early; the old master restarted
follows the new one in the newer epoch and hands nothing over on its own."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from delayhelpers import encoded
from delaywire import collect, now_ms, request, wait_until

from qmq.aio import Consumer, Producer
from qmq.client.connection import Connection
from qmq.common.errors import BrokerError, QmqError
from qmq.protocol.answers import answer_of
from qmq.protocol.codes import RequestCode
from qmq.testing import ReadyProcess, running_role

pytestmark = [pytest.mark.integration, pytest.mark.timeout(180)]

GROUP = "d1"
# handed over again after a promotion: those the old master handed over in its last moments
# (after the count asked of it before the kill, or before its slave heard of them)
_REPEATS_MAX = 600
FAST = ["--heartbeat-interval-ms", "300", "--slave-timeout-ms", "3000", "--checkpoint-interval-ms", "500"]


def meta_args(tmp_path: Path) -> list[str]:
    """A meta server under ``tmp_path`` that calls a server dead after 2 s of silence."""
    return ["meta", "--data-dir", str(tmp_path / "meta"), "--port", "0", "--heartbeat-timeout-ms", "2000"]


def delay_args(data_dir: Path, meta_server: str, role: str) -> list[str]:
    return ["delay", "--data-dir", str(data_dir), "--meta-server", meta_server, "--group", GROUP, "--role", role, *FAST]


def cluster_view(meta_server: str) -> dict[str, Any]:
    url = meta_server.removesuffix("/meta/address") + "/meta/cluster"
    with urllib.request.urlopen(url, timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


def wait_view(meta_server: str, what: str, ok: Callable[[dict[str, Any]], bool], timeout_s: float = 30) -> None:
    deadline = time.monotonic() + timeout_s
    view: dict[str, Any] = {}
    while time.monotonic() < deadline:
        view = cluster_view(meta_server)
        if ok(view):
            return
        time.sleep(0.05)  # polling the meta server's view, bounded by the deadline
    raise AssertionError(f"{what}: not so within {timeout_s} s; the meta server says {view}")


def delay_server(view: dict[str, Any], address: str) -> dict[str, Any] | None:
    return next((s for s in view["servers"] if s["role"] == "delay" and s["address"] == address), None)


def delay_group_row(view: dict[str, Any]) -> dict[str, Any]:
    [g] = [g for g in view["groups"] if g["role"] == "delay" and g["group"] == GROUP]
    return g


def replicating(meta_server: str, slave: ReadyProcess) -> None:
    def ok(view: dict[str, Any]) -> bool:
        s = delay_server(view, slave.ready["address"])
        return s is not None and s["role_in_group"] == "slave" and s["replicated_ms"] > 0

    wait_view(meta_server, "the delay slave replicating", ok)


async def stats(address: str) -> dict[str, Any]:
    doc: dict[str, Any] = answer_of(await request(address, RequestCode.DELAY_STATS, {}))
    return doc


async def pending(address: str) -> int:
    return int((await stats(address))["pending"])


def health(ready: ReadyProcess) -> dict[str, Any]:
    with urllib.request.urlopen(ready.ready["http"] + "/health", timeout=5) as resp:
        doc: dict[str, Any] = json.load(resp)
    return doc


@pytest.fixture
def group(tmp_path: Path) -> Iterator[tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack]]:
    with ExitStack() as stack:
        meta = stack.enter_context(running_role(meta_args(tmp_path)))
        url = meta.meta_server
        for group in ("b1", "b2"):  # each subject routed to both: a repeat must reach the group that stored it
            stack.enter_context(
                running_role(["broker", "--data-dir", str(tmp_path / group), "--meta-server", url, "--group", group,
                              "--heartbeat-interval-ms", "300"])
            )  # fmt: skip
        master = stack.enter_context(running_role(delay_args(tmp_path / "d1-m", url, "master")))
        slave = stack.enter_context(running_role(delay_args(tmp_path / "d1-s", url, "slave")))
        replicating(url, slave)
        yield url, tmp_path, master, slave, stack


async def test_a_send_and_a_cancel_are_answered_once_the_slave_has_them(
    group: tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack],
) -> None:
    url, _tmp, master, slave, _stack = group
    async with Producer(app_code="t", meta_server=url) as producer:
        ids = []
        for _ in range(30):
            m = producer.generate_message("slaves.copy")
            m.set_delay(timedelta(hours=1))
            await producer.send(m)
            ids.append(m.message_id)
            # answered: the slave has it (replayed into its schedule logs) already
            assert await pending(slave.ready["address"]) == len(ids)
        assert await producer.cancel_delay(ids[0]) is True
        assert await pending(slave.ready["address"]) == len(ids) - 1
    assert await pending(master.ready["address"]) == len(ids) - 1
    # the slave takes no sends: it names its master
    with pytest.raises(BrokerError, match="is a slave of delay group d1 \\(epoch 1\\); its master is"):
        await request(slave.ready["address"], RequestCode.CANCEL_DELAY, {"message_id": ids[1]})
    assert health(slave)["role_in_group"] == "slave"


async def _send_due(producer: Producer, n: int, spread_ms: int, lead_ms: int) -> dict[str, int]:
    """``n`` messages due from ``lead_ms`` to ``lead_ms + spread_ms`` from now: id -> due (ms)."""
    due: dict[str, int] = {}
    base = int(now_ms()) + lead_ms
    futures = []
    for i in range(n):
        m = producer.generate_message("slaves.due")
        at = base + i * spread_ms // n
        m.set_deliver_at(at / 1000)
        due[m.message_id] = at
        futures.append(producer.send_nowait(m))
    await asyncio.gather(*futures)
    return due


async def test_kill_9_of_the_master_promotes_the_slave_and_nothing_is_lost_early_or_twice(
    group: tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack],
) -> None:
    url, tmp, master, slave, stack = group
    n = 3_000
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url, consumer_id="c1") as consumer,
    ):
        pull = consumer.pull_consumer("slaves.due", "billing", start_from="earliest")
        repeats = consumer.pull_consumer("slaves.repeat", "billing", start_from="earliest")
        due = await _send_due(producer, n, spread_ms=8_000, lead_ms=2_000)
        # a repeating message whose copies come due on both sides of the kill
        every = producer.generate_message("slaves.repeat")
        every.set_repeat(every=timedelta(seconds=1), times=10)
        await producer.send(every)
        # cancels of messages due after the kill: the new master must not hand them over either
        cancelled = sorted(due, key=due.__getitem__)[-30:]
        assert all([await producer.cancel_delay(mid) for mid in cancelled])
        for mid in cancelled:
            del due[mid]
        got = await collect(pull, n // 4, timeout_s=30)  # some handed over by the master
        handed_before_kill = (await stats(master.ready["address"]))["dispatched_total"]
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait()
        got.update(await collect(pull, len(due) - len(got), timeout_s=60))
        # nothing more comes: what the old master handed over is not repeated by the new one
        got_more = await collect(pull, 1, timeout_s=3)
        assert not got_more.keys() & got.keys(), "a message was delivered twice to the group"
        got.update(got_more)
        assert not got.keys() & set(cancelled), "a message cancelled before the kill was delivered"
        assert got.keys() == due.keys(), f"{len(due.keys() - got.keys())} of {len(due)} messages were lost"
        copies: list[int] = []
        for _ in range(300):  # bounded: the last copy is due 10 s after the send
            batch = await repeats.pull(max_messages=100, timeout_ms=200)
            copies += [int(str(m.get_property("qmq.repeat.copy"))) for m in batch]
            await batch.ack_all()
            if len(copies) >= 10:
                break
        assert not await repeats.pull(max_messages=10, timeout_ms=1_000), "a copy of the repeat came twice"
        assert sorted(copies) == list(range(1, 11)), f"copies of the repeating message across the promotion: {copies}"
        early = [i for i, at in got.items() if at < due[i] - 5]
        assert not early, f"{len(early)} messages came early, e.g. {early[0]}: {got[early[0]] - due[early[0]]:.0f} ms"
        view = cluster_view(url)
        row = delay_group_row(view)
        assert (row["master"], row["epoch"]) == (slave.ready["address"], 2), row
        assert health(slave)["role_in_group"] == "master"
        # the new master knew what the old one had handed over (its dispatch logs were copied): it
        # handed over the rest, and at most the last few hundred again (dropped by the broker)
        again = await stats(slave.ready["address"])
        handed = again["dispatched_total"]
        assert handed <= n + 10 - handed_before_kill + _REPEATS_MAX, (
            f"the new master handed over {handed} of {n}; the old one {handed_before_kill} before the kill"
        )

        # the old master restarted on its data follows the new one in epoch 2 and hands nothing over
        old = stack.enter_context(running_role(delay_args(tmp / "d1-m", url, "master")))

        def following(v: dict[str, Any]) -> bool:
            s = delay_server(v, old.ready["address"])
            return s is not None and s["role_in_group"] == "slave" and s["epoch"] == 2 and s["replicated_ms"] > 0

        wait_view(url, "the old master following the new one", following)
        assert health(old)["role_in_group"] == "slave"
        later = await _send_due(producer, 200, spread_ms=1_000, lead_ms=1_000)
        assert await pending(old.ready["address"]) >= 1  # it copies the new master's sends
        got2 = await collect(pull, 200, timeout_s=30)
        assert got2.keys() == later.keys()
        assert not await collect(pull, 1, timeout_s=2), "something came twice or from the old master"
        assert (await stats(old.ready["address"]))["dispatched_total"] == 0


async def test_an_old_master_cuts_what_it_never_replicated_and_follows(
    group: tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack],
) -> None:
    url, tmp, master, slave, stack = group
    async with Producer(app_code="t", meta_server=url) as producer:
        for _ in range(20):
            m = producer.generate_message("slaves.cut")
            m.set_delay(timedelta(hours=1))
            await producer.send(m)
    ends: list[int] = []

    def copied(v: dict[str, Any]) -> bool:
        ends[:] = [s["log_end"] for s in v["servers"] if s["role"] == "delay"]
        return len(ends) == 2 and ends[0] == ends[1]

    wait_view(url, "the slave's copy as long as the master's log", copied)
    # The slave stops copying: the master writes the next two sends and waits for the slave in
    # vain (the first may still reach the slave, in the answer to the request it had waiting;
    # the second cannot: the stopped slave asks for nothing more).
    os.kill(slave.pid, signal.SIGSTOP)
    conn = Connection(master.ready["address"], connect_timeout_ms=3000)
    sent = []
    master_end = ends[0]
    try:
        for i in range(2):
            body = encoded("slaves.cut", f"never-replicated-{i}", int(now_ms()) + 3_600_000)
            sent.append(asyncio.ensure_future(conn.request(RequestCode.SEND_MESSAGES, {}, [body])))

            def written(v: dict[str, Any], before: int = master_end) -> bool:
                s = delay_server(v, master.ready["address"])
                return s is not None and s["log_end"] > before

            await asyncio.to_thread(wait_view, url, "the master writing the send", written, 1.5)
            master_end = delay_server(cluster_view(url), master.ready["address"])["log_end"]  # type: ignore[index]
        os.kill(master.pid, signal.SIGKILL)
        master.proc.wait()
    finally:
        os.kill(slave.pid, signal.SIGCONT)
    for fut in sent:
        with pytest.raises(QmqError):
            await fut  # never answered as stored
    await conn.close()

    def promoted(v: dict[str, Any]) -> bool:
        return delay_group_row(v)["master"] == slave.ready["address"] and delay_group_row(v)["epoch"] == 2

    wait_view(url, "the slave promoted", promoted)
    kept = await pending(slave.ready["address"])
    assert kept in (20, 21)
    new_end = delay_server(cluster_view(url), slave.ready["address"])
    assert new_end is not None
    assert new_end["log_end"] < master_end  # the old master wrote more than the new one has
    old = stack.enter_context(running_role(delay_args(tmp / "d1-m", url, "master")))

    def following(v: dict[str, Any]) -> bool:
        s = delay_server(v, old.ready["address"])
        return s is not None and s["role_in_group"] == "slave" and s["epoch"] == 2 and s["replicated_ms"] > 0

    wait_view(url, "the old master following the new one", following)
    # it cut what it never replicated: its copy is the new master's again
    assert await pending(old.ready["address"]) == kept
    old_end = delay_server(cluster_view(url), old.ready["address"])
    assert old_end is not None
    assert old_end["log_end"] == new_end["log_end"]


async def test_a_send_waiting_for_the_slave_when_its_master_stops_is_answered_not_master(
    group: tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack],
) -> None:
    """Answered so the producer sends it again to the group's master (it did not retry the
    INTERNAL_ERROR it met before: a delayed send failed in a rolling restart)."""
    url, _tmp, master, slave, _stack = group
    before = delay_server(cluster_view(url), master.ready["address"])
    assert before is not None
    os.kill(slave.pid, signal.SIGSTOP)  # the slave copies nothing more: the send waits for it
    conn = Connection(master.ready["address"], connect_timeout_ms=3000)
    try:
        body = encoded("slaves.stop", "waits-for-the-slave", int(now_ms()) + 3_600_000)
        sent = asyncio.ensure_future(conn.request(RequestCode.SEND_MESSAGES, {}, [body]))

        def written(v: dict[str, Any]) -> bool:
            s = delay_server(v, master.ready["address"])
            return s is not None and s["log_end"] > before["log_end"]

        await asyncio.to_thread(wait_view, url, "the master writing the send", written, 5)
        master.proc.send_signal(signal.SIGTERM)
        with pytest.raises(BrokerError) as refused:
            await sent
        assert (refused.value.status_name, refused.value.retriable) == ("NOT_MASTER", True), refused.value
        assert refused.value.outcome_unknown
        assert master.proc.wait(30) == 0
    finally:
        os.kill(slave.pid, signal.SIGCONT)
        await conn.close()


@pytest.mark.timeout(300)
async def test_a_master_cut_off_while_handing_over_comes_back_as_slave_and_loses_nothing_when_promoted_again(
    group: tuple[str, Path, ReadyProcess, ReadyProcess, ExitStack],
) -> None:
    """The network scenario's path, with SIGSTOP for the cut: the master hands over while a send
    it wrote never reaches its stopped slave; it is stopped in turn and the slave promoted (epoch
    2), which hands over on; the old master, back, cuts the send and follows, copying the new
    master's dispatch logs; then the new master is killed and the old one promoted again (epoch
    3). Every message acknowledged comes, none twice to the group: no dispatch-log entry either
    copy took names a message nobody handed over."""
    url, _tmp, master, slave, _stack = group
    n = 1_500
    async with (
        Producer(app_code="t", meta_server=url) as producer,
        Consumer(app_code="t", meta_server=url, consumer_id="c1") as consumer,
    ):
        pull = consumer.pull_consumer("slaves.due", "billing", start_from="earliest")
        due = await _send_due(producer, n, spread_ms=30_000, lead_ms=2_000)
        got = await collect(pull, n // 8, timeout_s=30)  # some handed over by the first master
        before = delay_server(cluster_view(url), master.ready["address"])
        assert before is not None
        os.kill(slave.pid, signal.SIGSTOP)
        conn = Connection(master.ready["address"], connect_timeout_ms=3000)
        try:
            await _cut_off_after_a_send_never_replicated(url, conn, master, slave, before["log_end"])
            await asyncio.to_thread(wait_view, url, "the slave promoted", _master_is(slave.ready["address"], 2))
            got.update(await collect(pull, n // 4 - len(got), timeout_s=30))  # handed over by the new master
        finally:
            os.kill(slave.pid, signal.SIGCONT)
            os.kill(master.pid, signal.SIGCONT)
            await conn.close()

        def following(v: dict[str, Any]) -> bool:
            s = delay_server(v, master.ready["address"])
            return s is not None and s["role_in_group"] == "slave" and s["epoch"] == 2 and s["replicated_ms"] > 0

        await asyncio.to_thread(wait_view, url, "the old master following the new one", following)
        got.update(await collect(pull, n // 3 - len(got), timeout_s=30))
        left = await pending(slave.ready["address"])
        assert left > 0, "every message came due before the second promotion: nothing left to test"
        await wait_until(
            "the old master's copy of what the new one handed over",
            lambda: _pending_at_most(master.ready["address"], slave.ready["address"]),
            timeout_s=30,
        )
        os.kill(slave.pid, signal.SIGKILL)
        slave.proc.wait()
        await asyncio.to_thread(wait_view, url, "the old master promoted again", _master_is(master.ready["address"], 3))
        got.update(await collect(pull, len(due) - len(got), timeout_s=90))
        got.update(await collect(pull, 1, timeout_s=3))
        assert "never-replicated" not in got
        assert got.keys() == due.keys(), f"{len(due.keys() - got.keys())} of {len(due)} messages were lost"


def _master_is(address: str, epoch: int) -> Callable[[dict[str, Any]], bool]:
    return lambda v: (delay_group_row(v)["master"], delay_group_row(v)["epoch"]) == (address, epoch)


async def _cut_off_after_a_send_never_replicated(
    url: str, conn: Connection, master: ReadyProcess, slave: ReadyProcess, log_end: int
) -> None:
    """With the slave stopped, a send the master writes and its slave never copies (never
    answered as stored); then the master is stopped in turn and the slave goes on."""
    body = encoded("slaves.due", "never-replicated", int(now_ms()) + 3_600_000)
    sent = asyncio.ensure_future(conn.request(RequestCode.SEND_MESSAGES, {}, [body]))

    def written(v: dict[str, Any]) -> bool:
        s = delay_server(v, master.ready["address"])
        return s is not None and s["log_end"] > log_end

    await asyncio.to_thread(wait_view, url, "the master writing the send", written, 5)
    os.kill(master.pid, signal.SIGSTOP)  # cut off in turn, handing over meanwhile
    os.kill(slave.pid, signal.SIGCONT)
    await conn.close()
    with pytest.raises(QmqError):
        await sent  # never answered as stored


async def _pending_at_most(address: str, than: str) -> bool:
    """Whether the delay server at ``address`` holds no more pending messages than ``than`` did
    just before (a slave's copy of its master's dispatch logs caught up, or nearly)."""
    bar = await pending(than)
    return await pending(address) <= bar + 50
