"""Checkpoints: written whole, and a damaged one never resets consumer groups without a word —
recovery falls back to an older one, or refuses to start unless told to accept the loss."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from conftest import append, batch, checkpoint, flush
from qmq.common.config import BrokerConfig
from qmq.store.broker_store import BrokerStore
from qmq.store.checkpoint import NAME, history, read_checkpoint, write_checkpoint
from qmq.store.datadir import StoreError


def consume_with_checkpoints(store: BrokerStore, rounds: int) -> None:
    """Pull and ack 2 messages a round, a checkpoint after each, with action-log segments so
    small that the oldest are deleted as checkpoints go by."""
    store.alog.segments.segment_bytes = 256
    append(store, batch("s", [str(i) for i in range(2 * rounds + 4)]))
    flush(store)
    gp = store.group("s", "g", "earliest")
    cp = gp.consumer("c")
    for _ in range(rounds):
        got = store.pull(gp, cp, "x", 2)
        assert got is not None
        store.ack(gp, cp, [[got.runs[0][0], got.runs[0][0] + 2]])
        checkpoint(store)


def refusal(directory: Path) -> str:
    """The StoreError opening the store in ``directory`` raises."""
    store = BrokerStore(BrokerConfig(data_dir=directory))
    with pytest.raises(StoreError) as refused:
        store.open()
    store.close()
    return str(refused.value)


def damage(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))


def test_a_short_write_is_carried_on_until_the_checkpoint_is_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_write = os.write
    monkeypatch.setattr(os, "write", lambda fd, data: real_write(fd, bytes(data)[:100]))
    state = {"version": 1, "blob": "x" * 5000}
    write_checkpoint(tmp_path, state, history_key=(7, 9), history_max=2)
    monkeypatch.undo()
    assert read_checkpoint(tmp_path) == state
    assert read_checkpoint(tmp_path, history(tmp_path)[0]) == state


def test_a_damaged_latest_checkpoint_falls_back_to_the_newest_kept_one_that_checks_out(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    consume_with_checkpoints(store, 12)
    assert store.alog.segments.start > 0  # older action-log segments are gone
    store.close()
    directory = tmp_path / "broker"
    damage(directory / NAME)
    damage(history(directory)[-1])  # the same checkpoint, kept
    again = open_store()
    gp = again.progress.get("s", "g")
    assert gp is not None  # not reset: the older checkpoint plus the action log after it
    assert (gp.pull_offset, gp.consumers["c"].ack_offset) == (24, 24)


def test_no_checkpoint_that_checks_out_refuses_to_start_naming_the_file_and_the_choice(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    consume_with_checkpoints(store, 12)
    start = store.alog.segments.start
    store.close()
    directory = tmp_path / "broker"
    for path in [directory / NAME, *history(directory)]:
        damage(path)
    text = refusal(directory)
    assert f"checkpoint {directory / NAME} is damaged (it fails its CRC)" in text
    assert f"the action log now begins at offset {start}" in text
    assert "--accept-progress-loss" in text
    assert "\n" not in text

    accepted = open_store(accept_progress_loss=True)
    assert accepted.subjects["s"].next_seq == 28  # messages are all there; only progress is lost
    accepted.close()


def test_no_checkpoint_at_all_after_the_action_log_was_trimmed_is_refused_too(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    consume_with_checkpoints(store, 12)
    store.close()
    directory = tmp_path / "broker"
    for path in [directory / NAME, *history(directory)]:
        path.unlink()
    assert refusal(directory).startswith(f"there is no checkpoint in {directory}; the action log now begins")


def test_a_fresh_directory_and_an_untrimmed_action_log_need_no_checkpoint(
    open_store: Callable[..., BrokerStore], tmp_path: Path
) -> None:
    store = open_store()
    consume_with_checkpoints(store, 1)
    assert store.alog.segments.start == 0
    store.close()
    damage(tmp_path / "broker" / NAME)
    for path in history(tmp_path / "broker"):
        damage(path)
    again = open_store()  # the whole action log is there: nothing is lost
    gp = again.progress.get("s", "g")
    assert gp is not None
    assert gp.consumers["c"].ack_offset == 2
