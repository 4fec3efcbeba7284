"""Replication at the store level: a slave's copy matches its master's, and a demoted master
cuts its logs back to its new master's copy."""

from __future__ import annotations

from pathlib import Path

from conftest import append, batch, flush
from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.store.broker_store import BrokerStore
from qmq.store.replica import append_actions, append_log, read_actions, read_log, rewind


def open_pair(tmp_path: Path, clock: ManualClock, **overrides: object) -> tuple[BrokerStore, BrokerStore]:
    stores = []
    for name in ("master", "slave"):
        s = BrokerStore(BrokerConfig(data_dir=tmp_path / name, **overrides), clock=clock)  # type: ignore[arg-type]
        s.open()
        stores.append(s)
    return stores[0], stores[1]


def catch_up(master: BrokerStore, slave: BrokerStore, max_bytes: int = 100_000) -> None:
    for _round in range(1000):
        log_chunk = read_log(master, slave.mlog.end, max_bytes)
        act_chunk = read_actions(master, slave.alog.end, max_bytes)
        if not log_chunk.data and not act_chunk.data:
            return
        append_log(slave, log_chunk)
        append_actions(slave, act_chunk)
    raise AssertionError("the slave did not catch up")


def same_bytes(a: Path, b: Path, suffix: str) -> bool:
    files_a = sorted(p.name for p in a.glob(f"*{suffix}"))
    files_b = sorted(p.name for p in b.glob(f"*{suffix}"))
    return files_a == files_b and all((a / n).read_bytes() == (b / n).read_bytes() for n in files_a)


def busy_master(master: BrokerStore) -> None:
    for k in range(8):
        append(master, batch(f"s{k % 3}", [f"m{k}-{i}" for i in range(50)], body=b"z" * 300))
    append(master, batch("%DEAD_RETRY%s0%g", ["dead-1"]))
    flush(master)
    gp = master.group("s0", "g", "earliest")
    cp = gp.consumer("c1")
    got = master.pull(gp, cp, "x", 70)
    assert got is not None
    master.ack(gp, cp, [[0, 30], [40, 50]])
    [letter] = master.dead.letters("%DEAD_RETRY%s0%g")
    master.remove_dead("%DEAD_RETRY%s0%g", [letter.number])
    append(master, batch("%DEAD_RETRY%s0%g", ["dead-2"]))


def test_a_slave_copy_is_byte_for_byte_and_indexed(tmp_path: Path, clock: ManualClock) -> None:
    master, slave = open_pair(tmp_path, clock, segment_bytes=64 * 1024)
    busy_master(master)
    catch_up(master, slave, max_bytes=20_000)
    assert len(master.mlog.segments.segments) > 2
    assert same_bytes(tmp_path / "master" / "log", tmp_path / "slave" / "log", ".log")
    assert same_bytes(tmp_path / "master" / "action", tmp_path / "slave" / "action", ".act")
    assert {n: s.next_seq for n, s in master.subjects.items()} == {n: s.visible_seq for n, s in slave.subjects.items()}
    assert master.progress.snapshot() == slave.progress.snapshot()
    assert [x.number for x in slave.dead.letters("%DEAD_RETRY%s0%g")] == [
        x.number for x in master.dead.letters("%DEAD_RETRY%s0%g")
    ]
    # the slave, promoted, serves the group where the master left it
    gp = slave.progress.get("s0", "g")
    assert gp is not None
    again = slave.pull(gp, gp.consumer("c1"), "after-failover", 100)
    assert again is not None
    assert again.runs[0][0] == 30  # redelivers what the consumer never acked, from pull-log offset 30
    master.close()
    slave.close()


def test_a_slave_copy_survives_its_own_restart(tmp_path: Path, clock: ManualClock) -> None:
    master, slave = open_pair(tmp_path, clock)
    busy_master(master)
    catch_up(master, slave)
    slave.close()
    slave = BrokerStore(BrokerConfig(data_dir=tmp_path / "slave"), clock=clock)
    slave.open()
    assert master.progress.snapshot() == slave.progress.snapshot()
    append(master, batch("s1", ["later"]))
    catch_up(master, slave)
    assert slave.subjects["s1"].visible_seq == master.subjects["s1"].next_seq
    master.close()
    slave.close()


def test_a_demoted_master_cuts_what_it_never_replicated(tmp_path: Path, clock: ManualClock) -> None:
    master, slave = open_pair(tmp_path, clock)
    busy_master(master)
    catch_up(master, slave)
    state = master.checkpoint_state()
    master.write_checkpoint(master.begin_flush(consume_logs=True), state)
    master.after_checkpoint(state)
    cut_message, cut_action = slave.mlog.end, slave.alog.end
    # writes that reach only the master, then a checkpoint that covers them
    append(master, batch("s0", ["lost-1", "lost-2"]))
    append(master, batch("%DEAD_RETRY%s0%g", ["lost-dead"]))
    gp = master.group("s0", "g2", "earliest")
    master.pull(gp, gp.consumer("c9"), "x", 5)
    state = master.checkpoint_state()
    master.write_checkpoint(master.begin_flush(consume_logs=True), state)
    master.after_checkpoint(state)
    rewind(master, cut_message, cut_action)
    assert (master.mlog.end, master.alog.end) == (cut_message, cut_action)
    assert master.progress.snapshot() == slave.progress.snapshot()
    assert {n: s.next_seq for n, s in master.subjects.items()} == {n: s.next_seq for n, s in slave.subjects.items()}
    assert [x.message_id for x in _ids(master)] == [x.message_id for x in _ids(slave)]
    # and it follows its new master from there
    append(slave, batch("s2", ["new-master"]))
    catch_up(slave, master)
    assert master.subjects["s2"].visible_seq == slave.subjects["s2"].next_seq
    master.close()
    slave.close()


def _ids(store: BrokerStore) -> list[object]:
    from qmq.protocol.message import decode_message

    out = []
    for letter in store.dead.letters("%DEAD_RETRY%s0%g", limit=1000):
        out.append(decode_message(letter.message))
    return out
