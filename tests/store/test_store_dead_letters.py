"""Dead letters are fsynced by the flush that answers their send, on the flusher's thread,
never by the append on the event loop's thread."""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import append, batch
from qmq.store.broker_store import BrokerStore
from qmq.store.dead_letters import LETTERS_FILE, REMOVED_FILE

DEAD = "%DEAD_RETRY%s%g"


@pytest.fixture
def fsyncs(monkeypatch: pytest.MonkeyPatch) -> Counter[str]:
    """fsync and fdatasync calls, counted by the name of the thread that made them."""
    calls: Counter[str] = Counter()
    for name in ("fsync", "fdatasync"):
        real = getattr(os, name)

        def counted(fd: int, real: Callable[[int], None] = real) -> None:
            calls[threading.current_thread().name] += 1
            real(fd)

        monkeypatch.setattr(os, name, counted)
    return calls


def flush_on_a_thread(store: BrokerStore, consume_logs: bool = False) -> set[int]:
    """Run a flush ticket on a thread named "flusher"; returns the inodes it fsynced."""
    ticket = store.begin_flush(consume_logs)
    inodes = {os.fstat(fd).st_ino for fd in ticket.fds}
    thread = threading.Thread(target=ticket.run, name="flusher")
    thread.start()
    thread.join()
    store.complete_flush(ticket)
    return inodes


def test_dead_letters_are_fsynced_by_the_next_flush_not_by_the_append(
    open_store: Callable[..., BrokerStore], tmp_path: Path, fsyncs: Counter[str]
) -> None:
    store = open_store()
    fsyncs.clear()  # a new store fsyncs the directories it made; appends fsync nothing
    for n in range(20):  # a storm of failing messages
        assert append(store, batch(DEAD, [f"d{n}"])).stored == 1
    assert fsyncs[threading.current_thread().name] == 0
    box = next((tmp_path / "broker" / "dead").iterdir())
    synced = flush_on_a_thread(store)
    assert (box / LETTERS_FILE).stat().st_ino in synced
    assert fsyncs["flusher"] >= 2  # the message log and the letters, and the new directories
    assert fsyncs[threading.current_thread().name] == 0

    store.remove_dead(DEAD, [store.dead.letters(DEAD)[0].number])
    assert fsyncs[threading.current_thread().name] == 0
    assert (box / REMOVED_FILE).stat().st_ino in flush_on_a_thread(store)
    assert not flush_on_a_thread(store) & {(box / LETTERS_FILE).stat().st_ino, (box / REMOVED_FILE).stat().st_ino}
    assert fsyncs[threading.current_thread().name] == 0
    store.close()

    again = open_store()
    assert again.dead.live(DEAD) == 19
