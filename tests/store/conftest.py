"""Helpers for store tests: build send batches and open stores in a temporary directory."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from qmq.common.clock import ManualClock
from qmq.common.config import BrokerConfig
from qmq.protocol.message import encode_message, encode_tags, scan_batch
from qmq.store.broker_store import BrokerStore


def batch(subject: str, ids: list[str], body: bytes = b"x" * 100, tags: tuple[str, ...] = ()) -> bytes:
    return b"".join(
        encode_message(subject.encode(), i.encode(), encode_tags(tags), len(tags), b"", body, 1) for i in ids
    )


def append(store: BrokerStore, body: bytes):  # type: ignore[no-untyped-def]
    return store.append(body, scan_batch(body))


def checkpoint(store: BrokerStore) -> None:
    state = store.checkpoint_state()
    store.write_checkpoint(store.begin_flush(consume_logs=True), state)
    store.after_checkpoint(state)


def flush(store: BrokerStore) -> set[str]:
    ticket = store.begin_flush()
    ticket.run()
    return store.complete_flush(ticket)


@pytest.fixture
def clock() -> ManualClock:
    return ManualClock()


@pytest.fixture
def open_store(tmp_path: Path, clock: ManualClock) -> Iterator[Callable[..., BrokerStore]]:
    opened: list[BrokerStore] = []

    def make(**overrides: object) -> BrokerStore:
        cfg = BrokerConfig(data_dir=tmp_path / "broker", **overrides)  # type: ignore[arg-type]
        store = BrokerStore(cfg, clock=clock)
        store.open()
        opened.append(store)
        return store

    yield make
    for store in opened:
        with contextlib.suppress(OSError):
            store.close()
