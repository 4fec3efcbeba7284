"""A write that fails leaves the store as it was: a send's batch is stored whole or not at all.
A full disk or no free file descriptor clears by itself; any other I/O error, or a failed
fsync, stops writes until a restart."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable
from typing import Any

import pytest
from test_store_send_pull import records

from conftest import append, batch, flush
from qmq.store.broker_store import BrokerStore
from qmq.store.consume_log import ConsumeLog
from qmq.store.datadir import DiskFullError, OutOfFilesError, StoreError
from qmq.store.dead_letters import DeadLetters
from qmq.store.message_log import MessageLog

DEAD = "%DEAD_RETRY%s%g"


def two_subjects(tag: str) -> bytes:
    return batch("a", [f"{tag}-a1", f"{tag}-a2"]) + batch("b", [f"{tag}-b1"]) + batch(DEAD, [f"{tag}-d1"])


def fail_when(monkeypatch: pytest.MonkeyPatch, cls: type, method: str, err: int, when: Callable[[Any], bool]) -> None:
    real = getattr(cls, method)

    def failing(self: Any, *args: Any) -> Any:
        if when(self):
            raise OSError(err, os.strerror(err))
        return real(self, *args)

    monkeypatch.setattr(cls, method, failing)


def everything(store: BrokerStore, subject: str) -> list[str]:
    gp = store.group(subject, "all", "earliest")
    got = store.pull(gp, gp.consumer("c"), "x", 1000)
    return [i for _s, i in records(got)] if got else []


def state(store: BrokerStore) -> tuple[int, int, int, int, int]:
    return (
        store.mlog.end,
        store.subjects["a"].next_seq,
        store.subjects["b"].next_seq,
        store.dedup.total_messages,
        store.dead.live(DEAD),
    )


@pytest.mark.parametrize(
    ("cls", "method", "when"),
    [
        (ConsumeLog, "append", lambda clog: clog.subject == "b"),  # after the message log and a's consume log
        (DeadLetters, "append", lambda _dead: True),  # after every consume log
        (MessageLog, "append", lambda _mlog: True),
    ],
    ids=["consume-log", "dead-letters", "message-log"],
)
@pytest.mark.parametrize(
    ("err", "refusal"), [(errno.ENOSPC, DiskFullError), (errno.EMFILE, OutOfFilesError)], ids=["disk-full", "no-fd"]
)
def test_a_full_disk_or_no_free_descriptor_undoes_the_batch_and_clears_by_itself(
    open_store: Callable[..., BrokerStore],
    monkeypatch: pytest.MonkeyPatch,
    cls: type,
    method: str,
    when: Any,
    err: int,
    refusal: type[StoreError],
) -> None:
    store = open_store()
    append(store, two_subjects("first"))
    flush(store)
    before = state(store)
    with monkeypatch.context() as patched:
        fail_when(patched, cls, method, err, when)
        with pytest.raises(refusal):
            append(store, two_subjects("second"))
    assert state(store) == before
    assert store.failed is None
    flush(store)
    assert everything(store, "a") == ["first-a1", "first-a2"]

    # space (or a descriptor) is free again: the producer's retry stores the batch once, where it belongs
    res = append(store, two_subjects("second"))
    assert (res.stored, res.duplicates) == (4, 0)
    flush(store)
    assert everything(store, "b") == ["first-b1", "second-b1"]
    assert store.dead.live(DEAD) == 2
    store.close()
    again = open_store()
    assert everything(again, "a") == ["first-a1", "first-a2", "second-a1", "second-a2"]
    assert again.dead.live(DEAD) == 2


def test_an_io_error_undoes_the_batch_and_stops_writes_until_a_restart(
    open_store: Callable[..., BrokerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    append(store, two_subjects("first"))
    flush(store)
    gp = store.group("a", "g", "earliest")
    cp = gp.consumer("c")
    before = state(store)
    with monkeypatch.context() as patched:
        fail_when(patched, ConsumeLog, "append", errno.EIO, lambda clog: clog.subject == "b")
        with pytest.raises(StoreError, match="restart the broker"):
            append(store, two_subjects("second"))
    assert state(store) == before
    assert store.failed is not None
    assert "a consume-log append failed" in store.failed
    assert "Input/output error" in store.failed
    for write in (
        lambda: append(store, two_subjects("third")),
        lambda: store.pull(gp, cp, "x", 10),
        lambda: store.ack(gp, cp, [[0, 1]]),
        lambda: store.group("a", "new-group", "earliest"),
        lambda: store.remove_dead(DEAD, [0]),
        lambda: store.write_checkpoint(store.begin_flush(consume_logs=True), store.checkpoint_state()),
    ):
        with pytest.raises(StoreError, match="stopped taking writes"):
            write()
    store.close()

    again = open_store()  # the restart
    assert again.failed is None
    res = append(again, two_subjects("second"))
    assert (res.stored, res.duplicates) == (4, 0)
    flush(again)
    assert everything(again, "b") == ["first-b1", "second-b1"]


def test_an_undo_that_fails_stops_writes(
    open_store: Callable[..., BrokerStore], monkeypatch: pytest.MonkeyPatch
) -> None:
    store = open_store()
    append(store, two_subjects("first"))
    fail_when(monkeypatch, ConsumeLog, "append", errno.ENOSPC, lambda clog: clog.subject == "b")
    fail_when(monkeypatch, MessageLog, "truncate", errno.EIO, lambda _mlog: True)
    with pytest.raises(StoreError, match="restart the broker"):
        append(store, two_subjects("second"))
    assert store.failed is not None
    assert "could not be undone" in store.failed


def test_a_failed_fsync_stops_writes(open_store: Callable[..., BrokerStore], monkeypatch: pytest.MonkeyPatch) -> None:
    store = open_store()
    append(store, two_subjects("first"))
    ticket = store.begin_flush()

    def failing(fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", failing)
    with pytest.raises(OSError, match="Input/output error"):
        ticket.run()
    assert store.failed is not None
    assert "an fsync failed" in store.failed
    with pytest.raises(StoreError, match="stopped taking writes"):
        append(store, two_subjects("second"))
